"""NodeWorkflow: one machine. Its agent registers through it; a heartbeating activity on the machine's own task
queue is its lease, so renewals cost no history. A lease that times out makes the machine Down."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import SCHEDULER_TASK_QUEUE, lease_task_queue
    from workflows.domain.nodes import NodeState, NodeStatusEntry, NodeView
    from workflows.domain.reasons import R, Reason
    from workflows.messages import (
        CordonRequest,
        GpuHealthReport,
        LeaseInput,
        MachineLostReport,
        NodeChangedInput,
        NodeInput,
        OrphanStoppedReport,
        PressureReport,
        RegisterRequest,
    )

PATIENT = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))


@workflow.defn(name=contracts.NODE_WORKFLOW)
class NodeWorkflow:
    @workflow.init
    def __init__(self, input: NodeInput) -> None:
        # Set before any handler runs: the agent's registration may arrive in the first activation.
        self._view: NodeView = input.view or NodeView(name=input.name, state=NodeState.DOWN)
        self._registrations = 0
        self._held = 0
        self._lease: asyncio.Task[None] | None = None

    @workflow.run
    async def run(self, input: NodeInput) -> None:
        settings = input.settings
        self._held = 0
        while True:
            await workflow.wait_condition(
                lambda: self._registrations != self._held or workflow.info().is_continue_as_new_suggested()
            )
            if self._registrations == self._held:
                workflow.continue_as_new(NodeInput(name=input.name, settings=settings, view=self._view))
            held = self._held = self._registrations
            await self._notify()
            expired = await self._hold_lease(settings.node_lease_ttl_seconds)
            if expired and self._registrations == held:
                self._view = self._view.model_copy(update={"holder": None})  # the lease is no one's any more
                if self._view.state is not NodeState.REMOVED:
                    lost_at = workflow.now()  # taken now: an agent may register while the scheduler is told
                    self._change(NodeState.DOWN, R.MachineLost())
                    await self._notify()
                    await self._tell_runs(removed=False, lost_at=lost_at)

    async def _hold_lease(self, ttl: float) -> bool:
        """Hold the lease until it expires (True) or a new registration replaces it (False)."""
        self._lease = asyncio.ensure_future(
            workflow.execute_activity(
                contracts.hold_lease,
                LeaseInput(node=self._view.name, renew_seconds=max(ttl / 3, 0.2)),
                task_queue=lease_task_queue(self._view.name, self._view.holder),
                start_to_close_timeout=timedelta(days=3650),
                heartbeat_timeout=timedelta(seconds=ttl),
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary="lease",
            )
        )
        try:
            await self._lease
        except ActivityError:
            return True
        except asyncio.CancelledError:
            return False
        return True

    async def _tell_runs(self, removed: bool, lost_at: datetime) -> None:
        """Every run with a worker on this machine learns it is gone (its workers go Down), and when: the report
        may reach a run after a new agent of the machine started one of its workers, which must not count lost."""
        await workflow.execute_activity(
            contracts.machine_lost,
            MachineLostReport(node=self._view.name, removed=removed, lost_at=lost_at),
            task_queue=SCHEDULER_TASK_QUEUE,  # the scheduler knows every worker on the machine
            start_to_close_timeout=timedelta(seconds=60),
            retry_policy=PATIENT,
            summary="tell runs the machine is lost",
        )

    async def _notify(self) -> None:
        await workflow.execute_activity(
            contracts.node_changed,
            NodeChangedInput(node=self._view),
            task_queue=SCHEDULER_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=PATIENT,
        )

    def _change(self, state: NodeState, reason: Reason) -> None:
        self._view = self._view.model_copy(update={"state": state, "since": workflow.now()})
        self._note(reason)

    def _note(self, reason: Reason) -> None:
        """A history entry in the machine's current state (its latest 50 are kept)."""
        entry = NodeStatusEntry(state=self._view.state, reason=reason.text, at=workflow.now())
        self._view = self._view.model_copy(update={"history": [*self._view.history, entry][-50:]})

    @workflow.update(name=contracts.REGISTER.name)
    def register(self, request: RegisterRequest) -> NodeView:
        """The agent (re)starts: record what the machine has, and take a new lease."""
        self._view = self._view.model_copy(update={"inventory": request.inventory, "holder": request.instance or None})
        self._change(NodeState.READY, R.NodeRegistered())
        self._registrations += 1
        if self._lease is not None and not self._lease.done():
            self._lease.cancel()  # the old lease belongs to an agent that is gone
        return self._view

    @register.validator
    def _validate_register(self, request: RegisterRequest) -> None:
        if request.inventory.name != self._view.name:
            raise ApplicationError(f"inventory of {request.inventory.name} sent to machine {self._view.name}")
        holder = self._view.holder
        if holder and request.instance != holder and request.take_over != holder:
            # Two agents of one machine would both take its workers' activities: the second one is refused.
            raise ApplicationError(
                f"machine {self._view.name} is held by agent {holder}, whose lease is live: stop that agent first, "
                "or give this one another --name",
                holder,
                type="LeaseHeld",
            )

    @workflow.update(name=contracts.REPORT_GPUS.name)
    async def report_gpus(self, report: GpuHealthReport) -> NodeView:
        """The agent saw GPUs fault or become at risk: keep the machine's GPUs and their health current, and
        record each new fault in the machine's history."""
        assert self._view.inventory is not None
        before = {gpu.index: gpu for gpu in self._view.inventory.gpus}
        inventory = self._view.inventory.model_copy(update={"gpus": report.gpus})
        self._view = self._view.model_copy(update={"inventory": inventory})
        for gpu in report.gpus:
            if gpu.fault is not None and gpu.fault != before[gpu.index].fault:
                self._note(R.GpuFault(index=gpu.index, fault=gpu.fault))
        await self._notify()
        return self._view

    @report_gpus.validator
    def _validate_report_gpus(self, report: GpuHealthReport) -> None:
        inventory = self._view.inventory
        if inventory is None:
            raise ApplicationError(f"machine {self._view.name} has not registered", type="NotRegistered")
        if [(g.index, g.uuid) for g in report.gpus] != [(g.index, g.uuid) for g in inventory.gpus]:
            raise ApplicationError(f"the GPUs reported are not those machine {self._view.name} registered")

    @workflow.update(name=contracts.REPORT_PRESSURE.name)
    async def report_pressure(self, report: PressureReport) -> NodeView:
        """The agent saw the machine come under memory or disk pressure, or leave it: keep the conditions in the
        inventory (the scheduler places nothing new there meanwhile), and record new pressure in its history."""
        assert self._view.inventory is not None
        before = self._view.inventory.pressure
        inventory = self._view.inventory.model_copy(update={"pressure": report.pressure})
        self._view = self._view.model_copy(update={"inventory": inventory})
        if report.pressure and set(report.pressure) - set(before):
            self._note(R.UnderPressure(condition=", ".join(report.pressure)))
        await self._notify()
        return self._view

    @report_pressure.validator
    def _validate_report_pressure(self, report: PressureReport) -> None:
        if self._view.inventory is None:
            raise ApplicationError(f"machine {self._view.name} has not registered", type="NotRegistered")

    @workflow.update(name=contracts.REPORT_ORPHAN_STOPPED.name)
    def report_orphan_stopped(self, report: OrphanStoppedReport) -> NodeView:
        """The agent stopped a worker whose run's workflow is no longer open (terminated in the Temporal UI, say), or
        an attempt its open run no longer has here: the machine's history says which, and why."""
        if report.attempt is not None:
            self._note(R.StaleAttemptStopped(task=report.task, attempt=report.attempt, run=report.run))
        else:
            self._note(R.OrphanStopped(task=report.task, run=report.run, status=report.status))
        return self._view

    @report_orphan_stopped.validator
    def _validate_report_orphan_stopped(self, report: OrphanStoppedReport) -> None:
        if self._view.inventory is None:
            raise ApplicationError(f"machine {self._view.name} has not registered", type="NotRegistered")

    # ---- admin verbs (astraeus nodes cordon|uncordon|remove) ------------------------------------------------------

    @workflow.update(name=contracts.CORDON.name)
    async def cordon(self, request: CordonRequest) -> NodeView:
        """No new work on the machine (what runs there stays) until it is uncordoned."""
        self._view = self._view.model_copy(update={"cordon": request.reason or "no reason given"})
        await self._notify()
        return self._view

    @workflow.update(name=contracts.UNCORDON.name)
    async def uncordon(self) -> NodeView:
        self._view = self._view.model_copy(update={"cordon": None})
        await self._notify()
        return self._view

    @uncordon.validator
    def _validate_uncordon(self) -> None:
        if self._view.cordon is None:
            raise ApplicationError(f"machine {self._view.name} is not cordoned", type="NotCordoned")

    @workflow.update(name=contracts.REMOVE.name)
    async def remove(self, request: CordonRequest) -> NodeView:
        """The machine leaves the cluster: the scheduler forgets it and its workers go Down ("Machine removed from
        the cluster"). An agent that registers again brings it back."""
        removed_at = workflow.now()
        self._change(NodeState.REMOVED, R.MachineRemoved())
        await self._notify()
        await self._tell_runs(removed=True, lost_at=removed_at)
        return self._view

    @cordon.validator
    def _validate_cordon(self, request: CordonRequest) -> None:
        if self._view.state is NodeState.REMOVED:
            raise ApplicationError(f"machine {self._view.name} was removed", type="Removed")

    @remove.validator
    def _validate_remove(self, request: CordonRequest) -> None:
        self._validate_cordon(request)

    @workflow.query(name=contracts.VIEW.name)
    def view(self) -> NodeView:
        return self._view
