"""SchedulerLeaseWorkflow (id `scheduler`): one scheduler places at a time. A scheduler process claims the lease
(update `claim`); while another live scheduler holds it the claim is refused, naming the holder and its epoch, and
the claimant waits as a standby. The lease, as a machine's, is a heartbeating activity on its holder's own queue, so
renewals cost no history: unheard for its TTL (its holder died, was paused or cut off), it times out and the lease is
no one's, for the next claim. Each grant has the next epoch. The decisions are pure
(workflows/domain/scheduling/lease.py); this workflow holds the lease and carries them out."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import scheduler_lease_task_queue
    from workflows.domain.scheduling.lease import ClaimLease, SchedulerLease, check_claim, decide_claim, decide_expired
    from workflows.messages import HoldSchedulerLeaseInput, SchedulerLeaseInput


@workflow.defn(name=contracts.SCHEDULER_LEASE_WORKFLOW)
class SchedulerLeaseWorkflow:
    @workflow.init
    def __init__(self, input: SchedulerLeaseInput) -> None:
        # Set before any handler runs: the first claim arrives with the workflow's start (update-with-start).
        self._lease = input.lease
        self._held = 0  # the epoch whose lease activity was started; 0: none yet
        self._holding: asyncio.Task[None] | None = None

    @workflow.run
    async def run(self, input: SchedulerLeaseInput) -> None:
        while True:
            await workflow.wait_condition(lambda: self._due() or self._may_continue())
            if not self._due():
                # Only between leases: a lease held runs on in its activity, which a new run would not have.
                workflow.continue_as_new(SchedulerLeaseInput(lease=self._lease))
            epoch = self._lease.epoch
            if await self._hold(self._lease) and self._lease.epoch == epoch:
                self._lease = decide_expired(self._lease, workflow.now())

    def _due(self) -> bool:
        """A lease granted whose activity has not been started yet."""
        return self._lease.holder is not None and self._held != self._lease.epoch

    def _may_continue(self) -> bool:
        return self._lease.holder is None and workflow.info().is_continue_as_new_suggested()

    async def _hold(self, lease: SchedulerLease) -> bool:
        """Hold the lease of `lease.epoch` until it ends: True when it expired (unheard for its TTL, never picked up
        within it, or ended by its holder), False when a newer grant replaced it."""
        assert lease.holder is not None
        self._held = lease.epoch
        ttl = timedelta(seconds=lease.ttl_seconds)
        holding = self._holding = asyncio.ensure_future(
            workflow.execute_activity(
                contracts.hold_scheduler_lease,
                HoldSchedulerLeaseInput(instance=lease.holder, epoch=lease.epoch, renew_seconds=lease.ttl_seconds / 3),
                task_queue=scheduler_lease_task_queue(lease.holder),
                start_to_close_timeout=timedelta(days=3650),
                schedule_to_start_timeout=ttl,  # a holder that died before polling its queue loses it too
                heartbeat_timeout=ttl,
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=f"scheduler lease, epoch {lease.epoch}",
            )
        )
        try:
            await holding
        except ActivityError:
            return True
        except asyncio.CancelledError:
            return False
        return True

    @workflow.update(name=contracts.CLAIM.name)
    def claim(self, claim: ClaimLease) -> SchedulerLease:
        """A scheduler takes the lease (`check_claim` took it): a new term, replacing any lease still held."""
        self._lease = decide_claim(self._lease, claim, workflow.now())
        if self._holding is not None and not self._holding.done():
            self._holding.cancel()  # the former term's: its holder is gone, or claimed again having lost it
        return self._lease

    @claim.validator
    def _validate_claim(self, claim: ClaimLease) -> None:
        refusal = check_claim(self._lease, claim)
        if refusal is not None:
            raise ApplicationError(refusal.message, *refusal.details, type=refusal.type)

    @workflow.query(name=contracts.LEASE.name)
    def lease(self) -> SchedulerLease:
        return self._lease
