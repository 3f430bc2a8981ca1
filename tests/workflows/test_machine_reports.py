"""What machines report beyond their lease, in virtual time: GPU health to their NodeWorkflow (`report_gpus`), and
a worker's log read on the machine that ran it (LogsWorkflow)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.exceptions import ActivityError, TimeoutError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fakes import unique
from workflows.contracts import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, node_id, node_task_queue
from workflows.domain.inventory import GpuInfo, NodeInventory, NodeView
from workflows.domain.machine.decisions import GpusReported, Registered
from workflows.domain.refs import TaskRef
from workflows.domain.settings import Settings
from workflows.logs import LogsWorkflow
from workflows.messages import LeaseInput, LogsInput, LogText, NodeChangedInput, NodeInput, ReadLogInput
from workflows.node import NodeWorkflow


def gpu(index: int, **health: str) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index}", model="H100", memory_bytes=80 << 30, **health)


class Machine:
    def __init__(self) -> None:
        self.seen: list[NodeView] = []

    @activity.defn(name="hold_lease")
    async def hold_lease(self, input: LeaseInput) -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(input.renew_seconds)

    @activity.defn(name="node_changed")
    async def node_changed(self, input: NodeChangedInput) -> None:
        self.seen.append(input.node)

    @activity.defn(name="read_log")
    async def read_log(self, input: ReadLogInput) -> LogText:
        return LogText(text=f"last {input.lines} lines of {input.ref.task_id}, at most {input.max_bytes} bytes\n")


async def test_a_machine_reports_a_gpu_fault_and_a_gpu_at_risk(time_skipping: WorkflowEnvironment) -> None:
    client, name, machine = time_skipping.client, unique("m"), Machine()
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34, gpus=[gpu(0), gpu(1), gpu(2)], gpu_source="nvml")
    async with (
        Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[NodeWorkflow]),
        Worker(client, task_queue=SCHEDULER_TASK_QUEUE, activities=[machine.node_changed]),
        Worker(client, task_queue=node_task_queue(name), activities=[machine.hold_lease]),
    ):
        handle = await client.start_workflow(
            NodeWorkflow.run, NodeInput(name=name, settings=Settings()), id=node_id(name), task_queue=CONTROL_TASK_QUEUE
        )
        with pytest.raises(WorkflowUpdateFailedError):  # not registered yet
            await handle.execute_update(NodeWorkflow.report_gpus, GpusReported(gpus=inventory.gpus))
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory))

        gpus = [gpu(0), gpu(1, fault="Xid 79 (GPU has fallen off the bus)"), gpu(2, at_risk="retired pages pending")]
        view = await handle.execute_update(NodeWorkflow.report_gpus, GpusReported(gpus=gpus))

        assert view.inventory is not None and view.inventory.gpus == gpus
        assert [g.healthy for g in view.inventory.gpus] == [True, False, False]
        assert [(e.state, e.reason) for e in view.history] == [
            ("Ready", "Registered by its agent"),
            ("Ready", "gpu fault on the machine: GPU 1: Xid 79 (GPU has fallen off the bus)"),
        ]
        assert machine.seen[-1] == view  # the scheduler was told
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(NodeWorkflow.report_gpus, GpusReported(gpus=[gpu(0), gpu(1)]))
        assert str(refused.value.cause.message) == f"the GPUs reported are not those machine {name} registered"
        assert (await handle.query(NodeWorkflow.view)) == view
        await handle.terminate()


async def test_a_log_is_read_on_the_machine_that_ran_the_worker(time_skipping: WorkflowEnvironment) -> None:
    client, node, machine = time_skipping.client, unique("m"), Machine()
    ref = TaskRef(namespace="default", job="hello", task_id="w-0", attempt=2)
    read = ReadLogInput(ref=ref, lines=50, max_bytes=1024)
    async with (
        Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[LogsWorkflow]),
        Worker(client, task_queue=node_task_queue(node), activities=[machine.read_log]),
    ):
        text = await client.execute_workflow(
            LogsWorkflow.run, LogsInput(node=node, read=read), id=unique("logs"), task_queue=CONTROL_TASK_QUEUE
        )

    assert text == LogText(text="last 50 lines of w-0, at most 1024 bytes\n")


async def test_a_machine_that_does_not_answer_fails_the_read_soon(time_skipping: WorkflowEnvironment) -> None:
    client = time_skipping.client
    read = ReadLogInput(ref=TaskRef(namespace="default", job="hello", task_id="w-0", attempt=1), lines=5, max_bytes=9)
    async with Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[LogsWorkflow]):
        with pytest.raises(WorkflowFailureError) as failed:  # no agent polls that machine's queue
            await client.execute_workflow(
                LogsWorkflow.run,
                LogsInput(node=unique("gone"), read=read, answer_within_seconds=0.5),
                id=unique("logs"),
                task_queue=CONTROL_TASK_QUEUE,
            )

    assert isinstance(failed.value.cause, ActivityError)
    assert isinstance(failed.value.cause.cause, TimeoutError)
