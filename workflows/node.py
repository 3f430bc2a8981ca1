"""NodeWorkflow: one machine. Its agent registers through it; a heartbeating activity on the machine's own task
queue is its lease, so renewals cost no history. A lease that times out makes the machine Down, its workers free to
run elsewhere once its agent's fence passed; one whose expiry came late (Temporal or the control plane was away) waits
a probation first, and an agent that registers again in it was never lost (workflows/domain/machine/fence.py). What
the machine becomes is decided in workflows/domain/machine/decisions.py; this workflow holds the lease and carries
out the commands."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime, timedelta
from typing import Literal

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.exceptions import TimeoutError as ActivityTimeout

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import SCHEDULER_TASK_QUEUE, lease_task_queue, node_task_queue
    from workflows.domain.inventory import NodeState, NodeView
    from workflows.domain.machine.decisions import (
        Cordoned,
        DataLocationChosen,
        DataReported,
        GpusReported,
        LeaseExpired,
        NewLease,
        NodeCommand,
        NodeEvent,
        Notify,
        OrphanStopped,
        PressureReported,
        Registered,
        Removed,
        TellRuns,
        Uncordoned,
        check,
        decide_node,
    )
    from workflows.domain.machine.fence import expired_late, fenced_at, probation
    from workflows.domain.machine.liveness import has_late_phase, late_after, noticed_late, renew_seconds, told_again
    from workflows.domain.run.events import MachineHeard, MachineLost
    from workflows.domain.settings import Settings
    from workflows.messages import CordonRequest, DataLocationRequest, LeaseInput, NodeChangedInput, NodeInput

DATA_LOCATION_ANSWER_SECONDS = 30  # a machine's agent takes up a chosen data location within this, or it is refused
# Since this change a run that grew long continues as new while it holds the lease too, carrying the lease over;
# runs started before it (replayed) waited for the lease to end first, however long their history grew.
CONTINUE_HOLDING_PATCH = "node-continues-as-new-holding-its-lease"
# Since this change a lease whose expiry came late waits a probation for its agent to register again; runs started
# before it (replayed) counted their machine lost at once.
PROBATION_PATCH = "node-lease-probation"
# Since this change the lease carries its workers' liveness (workflows/domain/machine/liveness.py): renewed three times
# within the stale grace, it is late after that grace (its runs hear it, and hear when it is taken again), and its
# runs hear of a new agent. Runs started before it (replayed) held a lease of the TTL, renewed three times within it.
LIVENESS_PATCH = "node-lease-carries-liveness"

LeaseEnd = Literal["expired", "replaced", "continue"]


@workflow.defn(name=contracts.NODE_WORKFLOW)
class NodeWorkflow:
    @workflow.init
    def __init__(self, input: NodeInput) -> None:
        # Set before any handler runs: the agent's registration may arrive in the first activation.
        self._view: NodeView = input.view or NodeView(name=input.name, state=NodeState.DOWN)
        self._registrations = 0
        self._held = 0
        self._lease: asyncio.Task[None] | None = None
        self._renewed_at: datetime | None = None  # the last renewal of the lease that expired, on its agent's clock
        # The agent whose lease was held last while the machine was not lost, and whether its runs heard it late:
        # what they hear when the lease is taken again (workflows/domain/machine/liveness.py).
        self._lease_holder: str | None = None
        self._told_late = False
        self._telling: asyncio.Task[None] | None = (
            None  # the latest tell of `machine_heard`: each waits for the one before
        )

    @workflow.run
    async def run(self, input: NodeInput) -> None:
        settings = input.settings
        self._held = 0
        carried = input.lease_held  # the former run held the lease: hold it on, the scheduler knows the machine
        if carried:
            self._lease_holder = self._view.holder
        while True:
            carry = carried and self._registrations == self._held  # not when an agent registered at once
            carried = False
            if not carry:
                await workflow.wait_condition(
                    lambda: (
                        self._registrations != self._held
                        or (workflow.info().is_continue_as_new_suggested() and self._told())
                    )
                )
                if self._registrations == self._held:
                    workflow.continue_as_new(NodeInput(name=input.name, settings=settings, view=self._view))
                self._held = self._registrations
                await self._notify()
                self._heard_again()
            held = self._held
            end = await self._hold_lease(settings, carry)
            if end == "continue":
                workflow.continue_as_new(
                    NodeInput(name=input.name, settings=settings, view=self._view, lease_held=True)
                )
            if end == "expired" and self._registrations == held and not await self._renewed_after_expiry(settings):
                await self._decide(LeaseExpired(fenced_at=fenced_at(workflow.now(), settings)))

    def _carries_liveness(self, settings: Settings) -> bool:
        return has_late_phase(settings) and workflow.patched(LIVENESS_PATCH)

    def _heard_again(self) -> None:
        """A lease is taken again while the machine was not lost (its agent registered again after its lease timed
        out, or a new agent took it over): its runs hear it, and attach the watches of their workers there again."""
        tell, new_agent = told_again(self._told_late, self._lease_holder, self._view.holder)
        if tell and workflow.patched(LIVENESS_PATCH):
            self._tell_heard(MachineHeard(node=self._view.name, late=False, at=workflow.now(), new_agent=new_agent))
        self._told_late = False
        self._lease_holder = self._view.holder

    async def _renewed_after_expiry(self, settings: Settings) -> bool:
        """Whether the lease that timed out was taken again before its machine counts lost. A lease that carries its
        workers' liveness times out late (its runs hear their workers there are Stale), then waits out the rest of
        its TTL for its agent; one whose lateness, or expiry, came late (the cluster was away) waits a probation."""
        if not self._carries_liveness(settings):
            return await self._renewed_in_probation(settings)
        now = workflow.now()
        if noticed_late(self._renewed_at, now, settings):
            workflow.logger.warning("%s: its lease went late while the cluster was away: waiting", self._view.name)
            return await self._registered_within(probation(settings))
        self._told_late = True
        self._tell_heard(MachineHeard(node=self._view.name, late=True, at=now))
        rest = timedelta(seconds=settings.node_lease_ttl_seconds - late_after(settings))
        return await self._registered_within(rest) or await self._renewed_in_probation(settings)

    async def _registered_within(self, timeout: timedelta) -> bool:
        held = self._registrations
        with contextlib.suppress(asyncio.TimeoutError):
            await workflow.wait_condition(lambda: self._registrations != held, timeout=timeout)
        return self._registrations != held

    async def _renewed_in_probation(self, settings: Settings) -> bool:
        """Whether the lease expired late (the cluster was away) and its agent registered again within the
        probation: the machine was never lost, and its workers run on."""
        if not expired_late(self._renewed_at, workflow.now(), settings) or not workflow.patched(PROBATION_PATCH):
            return False
        workflow.logger.warning("%s: its lease expired late: waiting for its agent to renew", self._view.name)
        return await self._registered_within(probation(settings))

    async def _hold_lease(self, settings: Settings, carried: bool) -> LeaseEnd:
        """Hold the lease until it expires, a new registration replaces it, or the history grew long enough to
        continue as new holding it (at a quiet moment: no update in flight). A lease carried over from the former
        run expires too if its agent does not take it up within its TTL (the agent died meanwhile). A lease that
        carries its workers' liveness times out at the stale grace (late), the rest of its TTL waited out after."""
        ttl, long_events = settings.node_lease_ttl_seconds, settings.continue_as_new_events
        timeout, renew = ttl, max(ttl / 3, 0.2)
        if self._carries_liveness(settings):
            timeout, renew = late_after(settings), renew_seconds(settings)
        lease = self._lease = asyncio.ensure_future(
            workflow.execute_activity(
                contracts.hold_lease,
                LeaseInput(node=self._view.name, renew_seconds=renew),
                task_queue=lease_task_queue(self._view.name, self._view.holder),
                start_to_close_timeout=timedelta(days=3650),
                schedule_to_start_timeout=timedelta(seconds=ttl) if carried else None,
                heartbeat_timeout=timedelta(seconds=timeout),
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary="lease",
            )
        )

        def long() -> bool:
            info = workflow.info()
            return info.is_continue_as_new_suggested() or info.get_current_history_length() >= long_events

        may_continue = True
        while may_continue:
            await workflow.wait_condition(
                lambda: lease.done() or (long() and workflow.all_handlers_finished() and self._told())
            )
            if lease.done():
                break
            if workflow.patched(CONTINUE_HOLDING_PATCH):
                return "continue"
            may_continue = False  # a run from before the patch: it waits for the lease to end
        try:
            await lease
        except ActivityError as error:
            self._renewed_at = _renewed_at(error)
            return "expired"
        except asyncio.CancelledError:
            return "replaced"
        return "expired"

    async def _decide(self, event: NodeEvent) -> NodeView:
        """Decide `event` and carry out its commands, in order."""
        self._view, commands = decide_node(self._view, event, workflow.now())
        for command in commands:
            await self._carry_out(command)
        return self._view

    async def _carry_out(self, command: NodeCommand) -> None:
        match command:
            case Notify():
                await self._notify()
            case TellRuns(removed=removed, lost_at=lost_at, fenced_at=fenced):
                self._lease_holder, self._told_late = None, False  # its runs hear it lost: nothing to tell after
                await self._tell_runs(removed, lost_at, fenced)
            case NewLease():
                self._replace_lease()

    def _replace_lease(self) -> None:
        self._registrations += 1  # the run's loop tells the scheduler and holds the new lease
        if self._lease is not None and not self._lease.done():
            self._lease.cancel()  # the old lease belongs to an agent that is gone

    def _validate(self, event: NodeEvent) -> None:
        refusal = check(self._view, event)
        if refusal is not None:
            raise ApplicationError(refusal.message, *refusal.details, type=refusal.type)

    async def _tell_runs(self, removed: bool, lost_at: datetime, fenced: datetime | None = None) -> None:
        """Every run with a worker on this machine learns it is gone (its workers go Down), and when: the report
        may reach a run after a new agent of the machine started one of its workers, which must not count lost; and
        until when a copy of its workers may still run there (`fenced`)."""
        await workflow.execute_activity(
            contracts.tell_runs_machine_lost,
            MachineLost(node=self._view.name, removed=removed, lost_at=lost_at, fenced_at=fenced),
            task_queue=SCHEDULER_TASK_QUEUE,  # the scheduler knows every worker on the machine
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=contracts.PATIENT,
            summary="tell runs the machine is lost",
        )

    def _told(self) -> bool:
        """Whether every `machine_heard` was told: the run may continue as new."""
        return self._telling is None or self._telling.done()

    def _tell_heard(self, report: MachineHeard) -> None:
        """Tell the machine's runs (through the scheduler, which knows its workers) that its lease is late, or heard
        again, beside the lease's loop (a renewal never waits for it), each tell after the one before."""
        before = self._telling

        async def tell() -> None:
            if before is not None:
                await before
            await workflow.execute_activity(
                contracts.tell_runs_machine_heard,
                report,
                task_queue=SCHEDULER_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=60),
                retry_policy=contracts.PATIENT,
                summary="tell runs the machine is late" if report.late else "tell runs the machine is heard again",
            )

        self._telling = asyncio.ensure_future(tell())

    async def _notify(self) -> None:
        await workflow.execute_activity(
            contracts.node_changed,
            NodeChangedInput(node=self._view),
            task_queue=SCHEDULER_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=contracts.PATIENT,
        )

    @workflow.update(name=contracts.REGISTER.name)
    def register(self, request: Registered) -> NodeView:
        """The agent (re)starts: record what the machine has, and take a new lease."""
        self._view, commands = decide_node(self._view, request, workflow.now())
        assert commands == [NewLease()]  # carried out here: the update answers at once
        self._replace_lease()
        return self._view

    @register.validator
    def _validate_register(self, request: Registered) -> None:
        self._validate(request)

    @workflow.update(name=contracts.REPORT_GPUS.name)
    async def report_gpus(self, report: GpusReported) -> NodeView:
        """The agent saw GPUs fault or become at risk: keep the machine's GPUs and their health current, and
        record each new fault in the machine's history."""
        return await self._decide(report)

    @report_gpus.validator
    def _validate_report_gpus(self, report: GpusReported) -> None:
        self._validate(report)

    @workflow.update(name=contracts.REPORT_PRESSURE.name)
    async def report_pressure(self, report: PressureReported) -> NodeView:
        """The agent saw the machine come under memory or disk pressure, or leave it: keep the conditions in the
        inventory (the scheduler places nothing new there meanwhile), and record new pressure in its history."""
        return await self._decide(report)

    @report_pressure.validator
    def _validate_report_pressure(self, report: PressureReported) -> None:
        self._validate(report)

    @workflow.update(name=contracts.REPORT_DATA.name)
    async def report_data(self, report: DataReported) -> NodeView:
        """The agent filled a copy of a drive, or its data location changed: its room and copies, for placement."""
        return await self._decide(report)

    @report_data.validator
    def _validate_report_data(self, report: DataReported) -> None:
        self._validate(report)

    @workflow.update(name=contracts.SET_DATA_LOCATION.name)
    async def set_data_location(self, request: DataLocationRequest) -> NodeView:
        """An admin chose where the machine keeps copies of drives (`astraeus nodes data-location`): its agent
        takes it up (a directory there, else the choice is refused with why) and says what is there."""
        try:
            report = await workflow.execute_activity(
                contracts.use_data_location,
                request,
                task_queue=node_task_queue(self._view.name),
                schedule_to_start_timeout=timedelta(seconds=DATA_LOCATION_ANSWER_SECONDS),
                start_to_close_timeout=timedelta(seconds=DATA_LOCATION_ANSWER_SECONDS),
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary="use data location",
            )
        except ActivityError as error:
            cause = error.cause
            if isinstance(cause, ApplicationError):
                raise ApplicationError(cause.message, type=cause.type) from None
            why = f"machine {self._view.name} did not answer (is its agent running?)"
            raise ApplicationError(f"data location {request.path}: {why}", type="NoAnswer") from None
        await self._decide(DataLocationChosen(path=request.path))
        return await self._decide(report)

    @set_data_location.validator
    def _validate_set_data_location(self, request: DataLocationRequest) -> None:
        self._validate(DataLocationChosen(path=request.path))

    @workflow.update(name=contracts.REPORT_ORPHAN_STOPPED.name)
    def report_orphan_stopped(self, report: OrphanStopped) -> NodeView:
        """The agent stopped a worker whose run's workflow is no longer open (terminated in the Temporal UI, say), or
        an attempt its open run no longer has here: the machine's history says which, and why."""
        self._view, commands = decide_node(self._view, report, workflow.now())
        assert not commands  # only its history changes
        return self._view

    @report_orphan_stopped.validator
    def _validate_report_orphan_stopped(self, report: OrphanStopped) -> None:
        self._validate(report)

    # ---- admin verbs (astraeus nodes cordon|uncordon|remove) ------------------------------------------------------

    @workflow.update(name=contracts.CORDON.name)
    async def cordon(self, request: CordonRequest) -> NodeView:
        """No new work on the machine (what runs there stays) until it is uncordoned."""
        return await self._decide(Cordoned(reason=request.reason))

    @cordon.validator
    def _validate_cordon(self, request: CordonRequest) -> None:
        self._validate(Cordoned(reason=request.reason))

    @workflow.update(name=contracts.UNCORDON.name)
    async def uncordon(self) -> NodeView:
        return await self._decide(Uncordoned())

    @uncordon.validator
    def _validate_uncordon(self) -> None:
        self._validate(Uncordoned())

    @workflow.update(name=contracts.REMOVE.name)
    async def remove(self, request: CordonRequest) -> NodeView:
        """The machine leaves the cluster: the scheduler forgets it and its workers go Down ("Machine removed from
        the cluster"). An agent that registers again brings it back."""
        return await self._decide(Removed(reason=request.reason))

    @remove.validator
    def _validate_remove(self, request: CordonRequest) -> None:
        self._validate(Removed(reason=request.reason))

    @workflow.query(name=contracts.VIEW.name)
    def view(self) -> NodeView:
        return self._view


def _renewed_at(error: ActivityError) -> datetime | None:
    """When the agent last renewed a lease that timed out, as it said with that renewal (its heartbeat's details);
    None when it did not say (an agent from before, or no renewal at all)."""
    cause = error.cause
    details = cause.last_heartbeat_details if isinstance(cause, ActivityTimeout) else ()
    if not details or not isinstance(details[0], str):
        return None
    try:
        renewed = datetime.fromisoformat(details[0])
    except ValueError:
        return None
    return renewed if renewed.tzinfo is not None else None
