"""NodeWorkflow: registration, a lease held by heartbeats, and a machine that goes Down when they stop."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

import pytest
from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fakes import FakeMachine, machine_workflow, unique
from workflows.contracts import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, lease_task_queue, node_id, node_task_queue
from workflows.domain.inventory import GpuInfo, NodeInventory
from workflows.domain.machine.decisions import Registered
from workflows.domain.run.events import MachineLost
from workflows.domain.settings import Settings
from workflows.messages import LeaseInput, NodeInput
from workflows.node import NodeWorkflow


async def test_a_machine_registers_loses_its_lease_and_comes_back(time_skipping: WorkflowEnvironment) -> None:
    client = time_skipping.client
    name = unique("m")
    machine = FakeMachine(name)
    inventory = NodeInventory(
        name=name, cpus=8, memory_bytes=2**34, gpus=[GpuInfo(index=0, uuid="GPU-0", model="L4", memory_bytes=2**34)]
    )
    async with machine_workflow(client, machine, inventory, Settings(node_lease_ttl_seconds=1)) as handle:
        view = await handle.query(NodeWorkflow.view)
        assert (view.state, view.inventory) == ("Ready", inventory)
        machine.alive = False
        for _ in range(100):
            view = await handle.query(NodeWorkflow.view)
            if view.state == "Down":
                break
            await asyncio.sleep(0.1)
        assert [(e.state, e.reason) for e in view.history] == [
            ("Ready", "Registered by its agent"),
            ("Down", "Machine lost: its lease expired"),
        ]
        lost_at = view.history[-1].at
        machine.alive = True
        view = await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory))
        assert view.state == "Ready"
        for _ in range(50):
            if machine.seen and machine.seen[-1].state == "Ready" and len(machine.seen) >= 3:
                break
            await asyncio.sleep(0.1)
        assert [v.state for v in machine.seen] == ["Ready", "Down", "Ready"]
        # its runs were told, and when it was lost: a run ignores it for a worker the new agent started since
        # and until when a copy of its workers may run there: the agent's fence (4 leases: 4 s) counts from its
        # last renewal, a lease (1 s) before it was lost at the latest, then each worker's stop grace (10 s) and the
        # clocks' skew (5 s)
        fenced = lost_at + timedelta(seconds=4 - 1 + 10 + 5)
        assert machine.lost == [MachineLost(node=name, removed=False, lost_at=lost_at, fenced_at=fenced)]
        await handle.terminate()


async def test_a_removed_machine_stays_removed_when_its_lease_then_expires(time_skipping: WorkflowEnvironment) -> None:
    from workflows.domain.run.events import MachineLost
    from workflows.messages import CordonRequest

    client = time_skipping.client
    name = unique("m")
    machine = FakeMachine(name)
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34)
    async with machine_workflow(client, machine, inventory, Settings(node_lease_ttl_seconds=1)) as handle:
        await handle.execute_update(NodeWorkflow.remove, CordonRequest(reason="decommissioned"))
        machine.alive = False  # its agent goes away: the lease expires after the removal
        await asyncio.sleep(3)
        view = await handle.query(NodeWorkflow.view)
        assert [(e.state, e.reason) for e in view.history] == [
            ("Ready", "Registered by its agent"),
            ("Ready", "An admin removes it: decommissioned"),  # the admin's reason, kept
            ("Removed", "Machine removed from the cluster"),
        ]
        assert machine.lost == [MachineLost(node=name, removed=True, lost_at=view.history[-1].at)]
        await handle.terminate()


async def test_an_orphan_stopped_by_the_agent_is_written_in_the_machines_history_once_registered(
    time_skipping: WorkflowEnvironment,
) -> None:
    from temporalio.client import WorkflowUpdateFailedError

    from workflows.domain.machine.decisions import OrphanStopped, Registered

    client = time_skipping.client
    name = unique("m")
    machine = FakeMachine(name)
    report = OrphanStopped(task="w-0", run="default/sleepy", status="terminated")
    async with (
        Worker(
            client, task_queue=CONTROL_TASK_QUEUE, workflows=[NodeWorkflow], activities=[machine.tell_runs_machine_lost]
        ),
        Worker(client, task_queue=SCHEDULER_TASK_QUEUE, activities=[machine.node_changed]),
        Worker(client, task_queue=node_task_queue(name), activities=[machine.hold_lease]),
    ):
        handle = await client.start_workflow(
            NodeWorkflow.run, NodeInput(name=name), id=node_id(name), task_queue=CONTROL_TASK_QUEUE
        )
        try:
            await handle.execute_update(NodeWorkflow.report_orphan_stopped, report)
        except WorkflowUpdateFailedError as refused:
            assert str(refused.cause) == f"NotRegistered: machine {name} has not registered"
        else:
            raise AssertionError("a machine that never registered took a report")
        await handle.execute_update(
            NodeWorkflow.register, Registered(inventory=NodeInventory(name=name, cpus=1, memory_bytes=2**30))
        )
        await handle.execute_update(NodeWorkflow.report_orphan_stopped, report)
        stale = OrphanStopped(task="w-1", run="default/sleepy", status="its run has attempt 4 here", attempt=3)
        view = await handle.execute_update(NodeWorkflow.report_orphan_stopped, stale)
        assert [(e.state, e.reason) for e in view.history] == [
            ("Ready", "Registered by its agent"),
            ("Ready", "Stopped worker w-0 of run default/sleepy: its run is no longer open (terminated)"),
            ("Ready", "Stopped worker w-1 (attempt 3) of run default/sleepy: its run no longer has it here"),
        ]
        await handle.terminate()


class FakeAgent(FakeMachine):
    """One agent process: it holds the lease on its own queue, and sees it cancelled when another takes over."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled = False

    @activity.defn(name="hold_lease")
    async def hold_lease(self, input: LeaseInput) -> None:
        try:
            await super().hold_lease(input)
        except asyncio.CancelledError:
            self.cancelled = True
            raise


async def test_a_second_agent_is_refused_while_the_first_holds_the_lease(time_skipping: WorkflowEnvironment) -> None:
    client = time_skipping.client
    name = unique("m")
    first, second, third = "host-a:101:aaaa", "host-a:202:bbbb", "host-b:303:cccc"
    agents = {instance: FakeAgent() for instance in (first, second)}
    control = FakeMachine(name)
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34)
    async with contextlib.AsyncExitStack() as stack:
        workers = [
            Worker(
                client,
                task_queue=CONTROL_TASK_QUEUE,
                workflows=[NodeWorkflow],
                activities=[control.tell_runs_machine_lost],
            ),
            Worker(client, task_queue=SCHEDULER_TASK_QUEUE, activities=[control.node_changed]),
        ] + [
            Worker(client, task_queue=lease_task_queue(name, instance), activities=[agent.hold_lease])
            for instance, agent in agents.items()
        ]
        for worker in workers:
            await stack.enter_async_context(worker)
        handle = await client.start_workflow(
            NodeWorkflow.run,
            NodeInput(name=name, settings=Settings(node_lease_ttl_seconds=1)),
            id=node_id(name),
            task_queue=CONTROL_TASK_QUEUE,
        )
        view = await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=first))
        assert (view.state, view.holder) == ("Ready", first)

        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=second))
        cause = refused.value.cause
        assert isinstance(cause, ApplicationError)
        assert (cause.type, cause.details, cause.message) == (
            "LeaseHeld",
            (first,),
            f"machine {name} is held by agent {first}, whose lease is live: stop that agent first, or give this one "
            "another --name",
        )
        view = await handle.query(NodeWorkflow.view)
        assert (view.holder, [(e.state, e.reason) for e in view.history]) == (
            first,
            [("Ready", "Registered by its agent")],
        )

        # An agent of the same host whose process is gone is taken over: its lease is cancelled.
        request = Registered(inventory=inventory, instance=second, take_over=first)
        view = await handle.execute_update(NodeWorkflow.register, request)
        assert view.holder == second
        for _ in range(50):
            if agents[first].cancelled:
                break
            await asyncio.sleep(0.1)
        assert agents[first].cancelled

        # Once the holder's lease expires the machine is no one's: any agent registers.
        agents[second].alive = False
        for _ in range(100):
            view = await handle.query(NodeWorkflow.view)
            if view.state == "Down":
                break
            await asyncio.sleep(0.1)
        assert (view.state, view.holder) == ("Down", None)
        view = await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=third))
        assert (view.state, view.holder) == ("Ready", third)
        await handle.terminate()
