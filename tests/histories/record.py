"""Record the committed histories that tests/workflows/test_replay.py replays.

Run `.venv/bin/python -m tests.histories.record [--suffix S] [STORY ...]` after an intended change to JobWorkflow; a
replay failure without such a change means the workflow code lost determinism, and old runs would break on upgrade.
Histories of an older protocol (or from before a `workflow.patched` change) are kept, and still replay: record the
new ones beside them with a suffix (`hello-p2.json`: a run created by a control plane speaking protocol 2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHandle, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster
from workers.connect import ensure_search_attributes
from workers.outcomes import run_result
from workflows.contracts import CONTROL_TASK_QUEUE, search_attributes
from workflows.domain.run.events import MachineHeard
from workflows.domain.run.status import Status
from workflows.domain.run.views import JobDescription
from workflows.domain.scheduling.planning import TaskPlan
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec
from workflows.job import JobWorkflow
from workflows.messages import JobInput

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent

W = {"name": "w", "command": ["x"]}
STORIES: dict[str, tuple[dict[str, Any], Script]] = {
    "hello": ({"groups": [W | {"replicas": 2}]}, Script()),
    "fail": ({"groups": [W | {"restart_policy": "Never"}]}, Script(exits={"w-0": [3]}, log_tail="boom\n")),
    "restarts": ({"groups": [W]}, Script(exits={"w-0": [3, 137, 0]})),
    "cancel": ({"groups": [W | {"replicas": 2}]}, Script(hold={"w-0"}, no_room={"w-1"})),
    # A gang whose member fails once: the barrier, a gang restart, the barrier again.
    "gang": ({"gang": True, "groups": [W | {"replicas": 3}]}, Script(exits={"w-1": [1, 0]})),
    # A group of total_gpus planned by the scheduler, and a group that waits for it to run.
    "groups": (
        {"groups": [W | {"total_gpus": 8}, {"name": "after", "command": ["x"], "depends_on": [{"group": "w"}]}]},
        Script(hold={"w-0", "w-1", "after-0"}, plans=[TaskPlan(workers=2, gpus_per_worker=4)]),
    ),
    # Temporal's cancellation request (the UI's button) is the run's cancel (CANCEL_REQUEST_PATCH). Since protocol 2
    # a run's outcome is its workflow's too: fail-p2 fails, cancel-p2 and ui-cancel-p2 are Canceled.
    "ui-cancel": ({"groups": [W | {"replicas": 2}]}, Script(hold={"w-0"}, no_room={"w-1"})),
    # A run that outlives its workflow run: w-0 runs on, its time limit armed, while w-1 restarts for ever; with a
    # short history_keep the workflow continues as new, and each next run picks the run up from its record
    # (workflows/domain/run/effects.py). Every run of the chain is recorded: continues-p5.json, continues-1-p5.json...
    "continues": (
        {"groups": [W | {"replicas": 2, "restart_policy": "Always", "time_limit_seconds": 86400}]},
        Script(hold={"w-0"}),
    ),
    # load_settings outlasts 80% of the workflow task's timeout (1.6 s of 2 here): the SDK completes that task
    # empty, and a replay takes it as one with the next, its clock later; the first decision is taken at `at`.
    "late-settings": ({"groups": [W]}, Script(settings_seconds=1.8)),
    # Protocol 7: its machine's lease carries the worker's liveness. The machine goes late (w-0 Stale), is heard again
    # (Running), then a new agent holds it (w-0's watch is attached again); then the run is cancelled.
    "heard": ({"groups": [W]}, Script(hold={"w-0"})),
}
SETTINGS = {"continues": Settings(history_keep=10)}
TASK_TIMEOUTS = {"late-settings": timedelta(seconds=2)}  # the others: Temporal's default (10 s)
CONTINUED_RUNS = 3  # the runs of the chain recorded for "continues"


async def record(stories: list[str], suffix: str) -> None:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"), data_converter=pydantic_data_converter
    )
    await ensure_search_attributes(env.client)
    for name in stories:
        fields, script = STORIES[name]
        spec = parse_spec({"name": name, **fields})
        async with fake_cluster(env.client, script, SETTINGS.get(name)):
            handle = await env.client.start_workflow(
                JobWorkflow.run,
                JobInput(spec=spec),
                id=spec.job_id,
                task_queue=CONTROL_TASK_QUEUE,
                search_attributes=search_attributes(spec, "Pending"),
                task_timeout=TASK_TIMEOUTS.get(name),
            )
            if name == "groups":  # once the group waiting for w runs too, cancel the run
                while (await handle.query("status", result_type=Status)).reason != "3 of 3 workers running":
                    await asyncio.sleep(0.05)
                await handle.execute_update("cancel", result_type=Status)
            if name in ("cancel", "ui-cancel"):
                while (await handle.query("status", result_type=Status)).state != "Running":
                    await asyncio.sleep(0.05)
                if name == "ui-cancel":
                    await handle.cancel()
                else:
                    await handle.execute_update("cancel", result_type=Status)
            if name == "heard":
                await _hear_the_machine(env, handle)
            if name == "continues":
                await _continue_as_new(env, handle, CONTINUED_RUNS)
                await handle.execute_update("cancel", result_type=Status)
            await run_result(handle)
            histories = await _chain(env, handle)
        for index, history in enumerate(histories):
            stem = f"{name}-{index}{suffix}" if index else f"{name}{suffix}"
            (HERE / f"{stem}.json").write_text(history.to_json())
            print(f"recorded {stem}: {len(history.events)} events")  # noqa: T201
    await env.shutdown()


async def _hear_the_machine(env: WorkflowEnvironment, handle: WorkflowHandle[Any, Any]) -> None:
    async def state(expected: str) -> None:
        while (await handle.query("status", result_type=Status)).state != expected:
            await asyncio.sleep(0.05)

    def heard(late: bool, new_agent: bool = False) -> MachineHeard:
        return MachineHeard(node="n0", late=late, new_agent=new_agent, at=datetime.now(UTC))

    await state("Running")
    for report, then in [(heard(late=True), "Stale"), (heard(late=False), "Running")]:
        await handle.signal("machine_heard", report)
        while (await handle.query("describe", result_type=JobDescription)).tasks[0].status.state != then:
            await asyncio.sleep(0.05)
    await handle.signal("machine_heard", heard(late=False, new_agent=True))
    await asyncio.sleep(1)  # its watch is attached again
    await handle.execute_update("cancel", result_type=Status)


async def _continue_as_new(env: WorkflowEnvironment, handle: WorkflowHandle[Any, Any], runs: int) -> None:
    """Let virtual time run until the workflow has had `runs` runs (it continued as new `runs - 1` times)."""
    for _ in range(2000):  # time skips only while the test server is asked to wait
        if len(await _chain(env, handle)) >= runs:
            return
        await env.sleep(5)
    raise AssertionError(f"{handle.id} did not continue as new {runs - 1} times")


async def _chain(env: WorkflowEnvironment, handle: WorkflowHandle[Any, Any]) -> list[WorkflowHistory]:
    """The history of each run of the workflow, the first one first (walking back from the latest)."""
    histories: list[WorkflowHistory] = []
    run_id: str | None = None
    while True:
        history = await env.client.get_workflow_handle(handle.id, run_id=run_id).fetch_history()
        histories.insert(0, history)
        started = history.events[0].workflow_execution_started_event_attributes
        if not started.continued_execution_run_id:
            return histories
        run_id = started.continued_execution_run_id


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--suffix", default="")
    parser.add_argument("stories", nargs="*", default=list(STORIES))
    args = parser.parse_args()
    asyncio.run(record(args.stories, args.suffix))
    sys.stdout.flush()
    os._exit(0)
