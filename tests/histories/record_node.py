"""Record the committed NodeWorkflow histories that tests/workflows/test_replay.py replays.

Run `.venv/bin/python -m tests.histories.record_node [STORY ...]` after an intended change to NodeWorkflow (gated with
`workflow.patched`; keep the old files, record the new ones beside them under new names).
- node-life: an agent registers; pressure, a GPU fault, a cordon and uncordon, an orphan stopped; the agent dies
  (Down, its runs told) and registers again.
- node-continued: a machine whose history grows while its lease is held continues as new holding it (the first run).
- node-liveness: a lease that carries its workers' liveness goes late (its runs told), is taken again (told back), is
  taken over by a new agent (told), then goes late again and expires (told late, then lost).
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fakes import FakeMachine
from workflows.contracts import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, lease_task_queue, node_id
from workflows.domain.inventory import GpuInfo, NodeInventory
from workflows.domain.machine.decisions import GpusReported, OrphanStopped, PressureReported, Registered
from workflows.domain.settings import Settings
from workflows.messages import CordonRequest, NodeInput
from workflows.node import NodeWorkflow

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
AGENT = "host:1:token"
GPU = GpuInfo(index=0, uuid="GPU-0", model="L4", memory_bytes=2**34)


async def life(env: WorkflowEnvironment, machine: FakeMachine) -> WorkflowHistory:
    client, name = env.client, "life"
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34, gpus=[GPU])
    settings = Settings(node_lease_ttl_seconds=1)
    handle = await client.start_workflow(
        NodeWorkflow.run, NodeInput(name=name, settings=settings), id=node_id(name), task_queue=CONTROL_TASK_QUEUE
    )
    async with Worker(client, task_queue=lease_task_queue(name, AGENT), activities=[machine.hold_lease]):
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=AGENT))
        await handle.execute_update(NodeWorkflow.report_pressure, PressureReported(pressure=["memory"]))
        fault = GPU.model_copy(update={"fault": "Xid 79 (GPU has fallen off the bus)"})
        await handle.execute_update(NodeWorkflow.report_gpus, GpusReported(gpus=[fault]))
        await handle.execute_update(NodeWorkflow.cordon, CordonRequest(reason="GPU 0"))
        await handle.execute_update(NodeWorkflow.uncordon)
        report = OrphanStopped(task="w-0", run="default/r", status="terminated")
        await handle.execute_update(NodeWorkflow.report_orphan_stopped, report)
        machine.alive = False
        while (await handle.query(NodeWorkflow.view)).state != "Down":
            await asyncio.sleep(0.1)
        machine.alive = True
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=AGENT))
        await asyncio.sleep(0.5)
        return await handle.fetch_history()


async def continued(env: WorkflowEnvironment, machine: FakeMachine) -> WorkflowHistory:
    client, name = env.client, "continued"
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34)
    settings = Settings(node_lease_ttl_seconds=5, continue_as_new_events=50)
    handle = await client.start_workflow(
        NodeWorkflow.run, NodeInput(name=name, settings=settings), id=node_id(name), task_queue=CONTROL_TASK_QUEUE
    )
    first = handle.result_run_id
    async with Worker(client, task_queue=lease_task_queue(name, AGENT), activities=[machine.hold_lease]):
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=AGENT))
        while (await handle.describe()).run_id == first:
            await handle.execute_update(NodeWorkflow.cordon, CordonRequest(reason="look"))
            await handle.execute_update(NodeWorkflow.uncordon)
        return await client.get_workflow_handle(handle.id, run_id=first).fetch_history()


async def liveness(env: WorkflowEnvironment, machine: FakeMachine) -> WorkflowHistory:
    client, name, other = env.client, "liveness", "host:2:other"
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34)
    settings = Settings(stale_grace_seconds=1, node_lease_ttl_seconds=3)
    handle = await client.start_workflow(
        NodeWorkflow.run, NodeInput(name=name, settings=settings), id=node_id(name), task_queue=CONTROL_TASK_QUEUE
    )

    async def told(count: int) -> None:
        while len(machine.told) < count:
            await asyncio.sleep(0.05)

    machine.told.clear()
    async with (
        Worker(client, task_queue=lease_task_queue(name, AGENT), activities=[machine.hold_lease]),
        Worker(client, task_queue=lease_task_queue(name, other), activities=[machine.hold_lease]),
    ):
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=AGENT))
        machine.alive = False
        await told(1)
        machine.alive = True
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory, instance=AGENT))
        await told(2)
        taken = Registered(inventory=inventory, instance=other, take_over=AGENT)
        await handle.execute_update(NodeWorkflow.register, taken)
        await told(3)
        machine.alive = False
        await told(5)
        assert machine.told == ["late", "back", "new agent", "late", "lost"], machine.told
        machine.alive = True
        return await handle.fetch_history()


async def record() -> None:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"), data_converter=pydantic_data_converter
    )
    machine = FakeMachine()
    async with (
        Worker(env.client, task_queue=CONTROL_TASK_QUEUE, workflows=[NodeWorkflow]),
        Worker(
            env.client,
            task_queue=SCHEDULER_TASK_QUEUE,
            activities=machine.scheduler_side(),
        ),
    ):
        stories = {"node-life": life, "node-continued": continued, "node-liveness": liveness}
        chosen = sys.argv[1:] or list(stories)
        for story, recorder in [(story, stories[story]) for story in chosen]:
            history = await recorder(env, machine)
            (HERE / f"{story}.json").write_text(history.to_json())
            print(f"recorded {story}: {len(history.events)} events")  # noqa: T201
    await env.shutdown()


if __name__ == "__main__":
    asyncio.run(record())
    sys.stdout.flush()
    os._exit(0)
