"""The scheduler's lease, pure: one scheduler places at a time. A scheduler claims the lease (update `claim` of
SchedulerLeaseWorkflow); `check_claim` says whether it is refused (another live scheduler holds it) and `decide_claim`
what the lease becomes: each grant (a new holder, or the same one taking it again after it lapsed) has the next
epoch, so that what a scheduler placed is told apart from what its predecessor placed. `decide_expired` frees it when
its holder goes unheard for its TTL. The workflow holds the lease (a heartbeating activity on the holder's own queue)
and carries the decisions out."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SchedulerLease(_Msg):
    """Who holds the scheduler's lease (`holder`: "host:pid:token", None while no one does), since when, for how long
    unheard (`ttl_seconds`, the holder's own setting), and the epoch of its term: 0 before the first holder, then
    one more at each grant."""

    holder: str | None = None
    epoch: int = 0
    since: datetime | None = None
    ttl_seconds: float = 15.0


class ClaimLease(_Msg):
    """A scheduler process asks for the lease (update `claim`): `instance` names it; `take_over` names a holder it
    found gone (a process of its own host that no longer runs), whose lease it takes at once; `ttl_seconds` is how
    long its lease lasts unheard."""

    instance: str = Field(min_length=1)
    ttl_seconds: float = Field(15.0, gt=0)
    take_over: str = ""


class LeaseRefusal(_Msg):
    """Why a claim is refused, as the validator raises it: a message people read, an error type and its details
    (the holder and its epoch, for the claimant's standby message)."""

    message: str
    type: str
    details: tuple[str, ...] = ()


def check_claim(lease: SchedulerLease, claim: ClaimLease) -> LeaseRefusal | None:
    """Whether the lease goes to `claim`; None when it does. Its holder may claim it again (it saw its lease lapse
    before the workflow did); a claimant that names the holder as gone takes it over; any other claimant waits while
    the lease lives."""
    holder = lease.holder
    if holder is None or holder == claim.instance or claim.take_over == holder:
        return None
    return LeaseRefusal(
        message=standby_message(holder, lease.epoch),
        type="LeaseHeld",
        details=(holder, str(lease.epoch)),
    )


def decide_claim(lease: SchedulerLease, claim: ClaimLease, now: datetime) -> SchedulerLease:
    """The lease after a claim `check_claim` took: the claimant's, in the next epoch. Every grant is a new term, its
    holder's own claim again too (it claims only once it counts its lease lost, and then rebuilds its view): the
    workflow holds a new lease on the claimant's queue, replacing any other."""
    return SchedulerLease(holder=claim.instance, epoch=lease.epoch + 1, since=now, ttl_seconds=claim.ttl_seconds)


def decide_expired(lease: SchedulerLease, now: datetime) -> SchedulerLease:
    """The holder went unheard for its TTL (it died, was paused or cut off): the lease is no one's; the epoch stays,
    and the next claim gets the one after it."""
    return lease.model_copy(update={"holder": None, "since": now})


def standby_message(holder: str, epoch: int) -> str:
    """What a standby scheduler answers at its door, and why a claim is refused."""
    return f"standby: scheduler {holder} holds the lease (epoch {epoch})"
