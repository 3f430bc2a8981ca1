"""The scheduler's lease as a scheduler process holds it: its claim (update `claim` of SchedulerLeaseWorkflow, id
`scheduler`), the activity that renews it by heartbeating on this process's own queue, and what tells that it was
lost: expired while this process was paused or cut off, or taken over. Only while `holds()` does the scheduler place;
the process (workers/services.py: SchedulerWorker) waits as a standby otherwise, its door refusing every call."""

from __future__ import annotations

import asyncio
import logging
import time

from temporalio import activity
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from activities.instances import gone, new_instance
from workflows import contracts
from workflows.contracts import SCHEDULER_LEASE_WORKFLOW_ID, implements
from workflows.domain.scheduling.lease import ClaimLease, SchedulerLease, standby_message
from workflows.domain.settings import Settings
from workflows.messages import HoldSchedulerLeaseInput, SchedulerLeaseInput

log = logging.getLogger(__name__)

EXPIRED = "its lease expired"  # unheard for its TTL (paused, cut off): it claims the lease again
TAKEN_OVER = "its lease was taken over"  # another scheduler holds it: this one waits as a standby


class LeaseHeld(Exception):
    """Another live scheduler holds the lease: this one waits as a standby. The message is the door's answer."""

    def __init__(self, holder: str, epoch: int) -> None:
        super().__init__(standby_message(holder, epoch))
        self.holder = holder
        self.epoch = epoch


class SchedulerLeaseHolder:
    """This scheduler process's side of the lease: `epoch` is the term it holds (0: none), renewed at `_renewed`."""

    def __init__(self, client: Client, settings: Settings, instance: str | None = None) -> None:
        self._client = client
        self.ttl = settings.scheduler_lease_ttl_seconds
        self.instance = instance or new_instance()  # "host:pid:token": the lease's queue is this process's own
        self.epoch = 0
        self._renewed = 0.0  # monotonic: the lease's grant, then each renewal
        self.lost = asyncio.Event()  # set when the term held is lost; cleared at the next grant
        self.why = "it has not claimed the scheduler's lease yet"  # why it does not hold it, for its door

    def holds(self, epoch: int | None = None) -> bool:
        """Whether this process holds the lease (of `epoch`, when given) now: granted, not lost, and renewed within
        its TTL. A process paused past its TTL holds nothing the moment it wakes, before its lease's loop runs."""
        held = self.epoch > 0 and (epoch is None or epoch == self.epoch)
        return held and not self.lost.is_set() and time.monotonic() - self._renewed < self.ttl

    async def claim(self) -> SchedulerLease:
        """Take the lease, starting its workflow on a fresh cluster (its first claim is granted at once); a holder of
        this host whose process is gone is taken over at once. Raises LeaseHeld while another live scheduler holds
        it; other errors (Temporal does not answer) are the caller's to try again."""
        handle = await contracts.singleton(
            self._client,
            contracts.SCHEDULER_LEASE_WORKFLOW,
            SchedulerLeaseInput(),
            SCHEDULER_LEASE_WORKFLOW_ID,
            "the scheduler's lease",
        )
        request = ClaimLease(instance=self.instance, ttl_seconds=self.ttl)
        while True:
            try:
                granted = await contracts.update(handle, contracts.CLAIM, request)
                break
            except WorkflowUpdateFailedError as error:
                cause = error.cause
                if not (isinstance(cause, ApplicationError) and cause.type == "LeaseHeld" and cause.details):
                    raise
                holder, epoch = str(cause.details[0]), int(cause.details[1])
                if request.take_over or not gone(holder):
                    raise LeaseHeld(holder, epoch) from None
                log.warning("the scheduler %s that held the lease (epoch %d) is gone: taking it over", holder, epoch)
                request = request.model_copy(update={"take_over": holder})
        self.epoch, self._renewed, self.why = granted.epoch, time.monotonic(), ""
        self.lost.clear()
        return granted

    def _lose(self, epoch: int, why: str) -> None:
        if epoch == self.epoch and not self.lost.is_set():
            log.warning("the scheduler lost its lease (epoch %d): %s; it places nothing more", epoch, why)
            self.why = f"it lost its lease (epoch {epoch}): {why}"
            self.lost.set()

    def lose(self, why: str) -> None:
        """Count the term held lost (its renewals stopped reaching this process): it places nothing more."""
        self._lose(self.epoch, why)

    @implements(contracts.hold_scheduler_lease)
    async def hold(self, input: HoldSchedulerLeaseInput) -> None:
        """Renew the lease by heartbeating until the lease's workflow cancels it (a newer term replaced it), or this
        process finds it was unheard for longer than the lease (it was paused): then the lease is lost."""
        ttl = 3 * input.renew_seconds
        renewed = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now - renewed > ttl:
                    self._lose(input.epoch, f"{EXPIRED}: this scheduler was unheard for {now - renewed:.1f} s")
                    return
                activity.heartbeat()
                renewed = now
                if input.epoch == self.epoch:
                    self._renewed = now
                await asyncio.sleep(input.renew_seconds)
        except asyncio.CancelledError:
            details = activity.cancellation_details()
            if details is None or not details.worker_shutdown:
                expired = details is not None and (details.not_found or details.timed_out)
                self._lose(input.epoch, EXPIRED if expired else TAKEN_OVER)
            raise
