"""Record the committed NodeWorkflow histories that tests/workflows/test_replay.py replays.

Run `.venv/bin/python -m tests.histories.record_node` after an intended change to NodeWorkflow (gated with
`workflow.patched`; keep the old files, record the new ones beside them under new names).
- node-life: an agent registers; pressure, a GPU fault, a cordon and uncordon, an orphan stopped; the agent dies
  (Down, its runs told) and registers again.
- node-continued: a machine whose history grows while its lease is held continues as new holding it (the first run).
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
            activities=[machine.node_changed, machine.tell_runs_machine_lost],
        ),
    ):
        for story, recorder in [("node-life", life), ("node-continued", continued)]:
            history = await recorder(env, machine)
            (HERE / f"{story}.json").write_text(history.to_json())
            print(f"recorded {story}: {len(history.events)} events")  # noqa: T201
    await env.shutdown()


if __name__ == "__main__":
    asyncio.run(record())
    sys.stdout.flush()
    os._exit(0)
