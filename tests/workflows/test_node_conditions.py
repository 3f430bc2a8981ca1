"""NodeWorkflow keeps what its agent reports of the machine's conditions (update `report_pressure`), in virtual
time: the inventory's pressure, a history entry when the machine comes under pressure, and the scheduler told."""

from __future__ import annotations

import asyncio

import pytest
from temporalio import activity
from temporalio.client import WorkflowUpdateFailedError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fakes import unique
from workflows.contracts import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, node_id, node_task_queue
from workflows.domain.inventory import NodeInventory, NodeView
from workflows.domain.machine.decisions import PressureReported, Registered
from workflows.domain.run.events import MachineLost
from workflows.domain.settings import Settings
from workflows.messages import LeaseInput, NodeChangedInput, NodeInput
from workflows.node import NodeWorkflow


class Machine:
    def __init__(self) -> None:
        self.seen: list[NodeView] = []

    @activity.defn(name="hold_lease")
    async def hold_lease(self, input: LeaseInput) -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(input.renew_seconds)

    @activity.defn(name="machine_lost")
    async def tell_runs_machine_lost(self, report: MachineLost) -> int:
        return 0

    @activity.defn(name="node_changed")
    async def node_changed(self, input: NodeChangedInput) -> None:
        self.seen.append(input.node)


async def test_pressure_reported_by_the_agent_is_kept_recorded_and_told(time_skipping: WorkflowEnvironment) -> None:
    client = time_skipping.client
    name = unique("m")
    machine = Machine()
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34, capabilities=["sandbox"])
    async with (
        Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[NodeWorkflow]),
        Worker(
            client, task_queue=SCHEDULER_TASK_QUEUE, activities=[machine.node_changed, machine.tell_runs_machine_lost]
        ),
        Worker(client, task_queue=node_task_queue(name), activities=[machine.hold_lease]),
    ):
        handle = await client.start_workflow(
            NodeWorkflow.run,
            NodeInput(name=name, settings=Settings(node_lease_ttl_seconds=30)),
            id=node_id(name),
            task_queue=CONTROL_TASK_QUEUE,
        )
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory))
        view = await handle.execute_update(NodeWorkflow.report_pressure, PressureReported(pressure=["memory"]))
        assert view.inventory is not None and view.inventory.pressure == ["memory"]
        assert view.inventory.capabilities == ["sandbox"]  # the rest of the inventory stays
        assert machine.seen[-1] == view  # the scheduler was told before the update returned
        view = await handle.execute_update(NodeWorkflow.report_pressure, PressureReported(pressure=["memory", "disk"]))
        view = await handle.execute_update(NodeWorkflow.report_pressure, PressureReported(pressure=["disk"]))
        view = await handle.execute_update(NodeWorkflow.report_pressure, PressureReported(pressure=[]))
        assert view.inventory is not None and view.inventory.pressure == []
        assert machine.seen[-1] == view
        assert [(e.state, e.reason) for e in view.history] == [
            ("Ready", "Registered by its agent"),
            ("Ready", "under pressure: memory"),
            ("Ready", "under pressure: memory, disk"),
        ]  # only a new condition is recorded; the spec has no reason for pressure that ends
        assert (await handle.query(NodeWorkflow.view)) == view
        await handle.terminate()


async def test_pressure_from_a_machine_that_never_registered_is_refused(time_skipping: WorkflowEnvironment) -> None:
    client = time_skipping.client
    name = unique("m")
    async with Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[NodeWorkflow]):
        handle = await client.start_workflow(
            NodeWorkflow.run, NodeInput(name=name, settings=Settings()), id=node_id(name), task_queue=CONTROL_TASK_QUEUE
        )
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(NodeWorkflow.report_pressure, PressureReported(pressure=["memory"]))
        assert "has not registered" in str(refused.value.cause)
        await handle.terminate()
