"""A machine whose history grows while its agent holds the lease continues as new holding it: the new run takes the
lease up on the same agent, which never counts it lost, and the machine keeps its state."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import WorkflowExecutionStatus, WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.agent import AgentActivities
from activities.agent.prepare import Preparer
from activities.agent.runtime.process import ProcessRuntime
from tests.workflows.fakes import unique
from workflows.contracts import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, lease_task_queue, node_id
from workflows.domain.inventory import NodeInventory, NodeView
from workflows.domain.machine.decisions import Registered
from workflows.domain.run.events import MachineLost
from workflows.domain.settings import Settings
from workflows.messages import CordonRequest, NodeChangedInput, NodeInput
from workflows.node import NodeWorkflow

AGENT = "host:1:token"


class Scheduler:
    """What the scheduler hears of the machine `name` (its queue is shared with other tests' machines)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seen: list[NodeView] = []
        self.lost: list[MachineLost] = []

    @activity.defn(name="machine_lost")
    async def tell_runs_machine_lost(self, report: MachineLost) -> int:
        if report.node == self.name:
            self.lost.append(report)
        return 0

    @activity.defn(name="node_changed")
    async def node_changed(self, input: NodeChangedInput) -> None:
        if input.node.name == self.name:
            self.seen.append(input.node)


async def until(condition: Callable[[], Any], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not await condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.05)


async def lease_held(handle: WorkflowHandle[Any, Any]) -> bool:
    """The machine's current run has its lease activity started (on the agent)."""
    pending = (await handle.describe()).raw_description.pending_activities
    return any(a.activity_type.name == "hold_lease" and a.attempt >= 1 and a.last_started_time.seconds for a in pending)


async def test_a_machine_continues_as_new_holding_its_lease_and_its_agent_never_counts_it_lost(
    time_skipping: WorkflowEnvironment, tmp_path: Path
) -> None:
    client = time_skipping.client
    name = unique("m")
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34)
    agent = AgentActivities(client, inventory, ProcessRuntime(tmp_path / "tasks"), Preparer(tmp_path), instance=AGENT)
    scheduler = Scheduler(name)
    settings = Settings(node_lease_ttl_seconds=3, continue_as_new_events=50)
    async with (
        Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[NodeWorkflow]),
        Worker(
            client,
            task_queue=SCHEDULER_TASK_QUEUE,
            activities=[scheduler.node_changed, scheduler.tell_runs_machine_lost],
        ),
        Worker(client, task_queue=lease_task_queue(name, AGENT), activities=[agent.hold_lease]),
    ):
        handle = await client.start_workflow(
            NodeWorkflow.run, NodeInput(name=name, settings=settings), id=node_id(name), task_queue=CONTROL_TASK_QUEUE
        )
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=AGENT))
        first = (await handle.describe()).run_id
        await until(lambda: lease_held(handle))
        seen = {first}
        for n in range(12):  # each cordon and uncordon adds some 8 events: past 50 twice at least
            await handle.execute_update(NodeWorkflow.cordon, CordonRequest(reason=f"look {n}"))
            await handle.execute_update(NodeWorkflow.uncordon)
            seen.add((await handle.describe()).run_id)
        await handle.execute_update(NodeWorkflow.cordon, CordonRequest(reason="the last look"))
        assert len(seen) >= 3, "the machine's workflow did not continue as new while its lease was held"
        status = (await client.get_workflow_handle(handle.id, run_id=first).describe()).status
        assert status == WorkflowExecutionStatus.CONTINUED_AS_NEW
        await until(lambda: lease_held(handle))
        await asyncio.sleep(4)  # longer than the lease's TTL: the former runs' lease activities have ended by now
        assert await lease_held(handle)
        assert not agent.lost.is_set(), agent.lost_why

        view = await handle.query(NodeWorkflow.view)
        assert (view.state, view.holder, view.cordon) == ("Ready", AGENT, "the last look")
        assert [(e.state, e.reason) for e in view.history] == [("Ready", "Registered by its agent")]
        assert scheduler.lost == [] and {v.state for v in scheduler.seen} == {"Ready"}
        # Ended here: left running, its lease would expire and tell the next test's scheduler it is Down.
        await handle.terminate()
