"""A machine's lease carries its workers' liveness (Kubernetes' node lease, with pod status told on change only).

Its agent renews one lease for the whole machine, and a worker's own watch sends nothing while it runs: it reports its
start and its end, no heartbeat. So the lease says what a heartbeat per worker said, at the cost of one write per
machine per renewal:
- renewals late by the stale grace (`late_after`): the machine's running workers are Stale ("Heartbeat lease
  expired"); renewals again (its agent registers again): Running ("Heartbeat received");
- unrenewed for the machine's TTL: the machine is Down and its workers too ("Machine lost: its lease expired"),
  restarted elsewhere once their copies are surely stopped (`workflows/domain/machine/fence.py`);
- its agent registered again (its lease timed out: it was late, or Temporal was away) or restarted (another process
  took the machine over while the lease was live): the runs attach their watches there again, and the agent finds
  the workers it kept or adopted, and the exits they left (a watch's answer sent while Temporal was away is lost).

Runs hear it through the scheduler (signal `machine_heard`), which knows every worker on the machine.
"""

from __future__ import annotations

from datetime import datetime

from workflows.domain.settings import Settings

# The shortest renewal interval: renewals are writes, and a lease shorter than this is a test's.
RENEW_FLOOR_SECONDS = 0.2


def late_after(settings: Settings) -> float:
    """How long a lease may go unrenewed before its machine's workers are Stale: the stale grace, or the TTL when
    that is shorter (the machine is Down first then)."""
    return min(settings.stale_grace_seconds, settings.node_lease_ttl_seconds)


def renew_seconds(settings: Settings) -> float:
    """How often an agent renews its lease: three renewals within `late_after`, so that one lost or slow renewal
    never makes a machine's workers Stale."""
    return max(late_after(settings) / 3, RENEW_FLOOR_SECONDS)


def has_late_phase(settings: Settings) -> bool:
    """Whether a lease is late (its workers Stale) before it expires: when the grace is shorter than the TTL."""
    return late_after(settings) < settings.node_lease_ttl_seconds


def noticed_late(renewed_at: datetime | None, now: datetime, settings: Settings) -> bool:
    """Whether a lease's lateness reached its workflow late: its last renewal (`renewed_at`, on the agent's clock, sent
    with it) lies more than `late_after`, a renewal and the clocks' skew before `now`. Seen on time: the machine is
    unheard (its workers Stale). Seen late: the cluster was away, which says nothing of the machine: its workers stay
    as they are while its agent renews (the probation: `workflows/domain/machine/fence.py`)."""
    if renewed_at is None:
        return False
    seconds = late_after(settings) + renew_seconds(settings) + settings.clock_skew_seconds
    return (now - renewed_at).total_seconds() > seconds


def told_again(told_late: bool, holder_before: str | None, holder_now: str | None) -> tuple[bool, bool]:
    """What the runs of a machine hear when its lease is taken again while the machine was not lost: whether to tell
    them (its renewals are heard again: they attach their watches there again, since an exit a watch returned while
    the lease was late or Temporal away may have reached no one), and whether its agent is a new one. Nothing to tell
    of a first registration, nor of one after the machine was lost (its runs heard that)."""
    new_agent = holder_before is not None and holder_now != holder_before
    return told_late or holder_before is not None, new_agent
