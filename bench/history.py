"""History events per restart and per continue-as-new, on the time-skipping test server with the workflow tests'
fake scheduler and agent (`python -m bench.history [--restarts N] [--continue-as-new-events E]`)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster
from workers.connect import ensure_search_attributes
from workers.outcomes import run_result
from workflows.contracts import CONTROL_TASK_QUEUE, search_attributes
from workflows.domain.run.status import Status
from workflows.domain.run.views import JobDescription
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec
from workflows.job import JobWorkflow
from workflows.messages import JobInput

BIN = Path(sys.executable).parent


async def measure(restarts: int, continue_as_new_events: int) -> None:
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"), data_converter=pydantic_data_converter
    )
    await ensure_search_attributes(env.client)
    spec = parse_spec({"name": "forever", "groups": [{"name": "w", "command": ["x"], "restart_policy": "Always"}]})
    settings = Settings(continue_as_new_events=continue_as_new_events)
    async with fake_cluster(env.client, Script(), settings):
        await env.client.start_workflow(
            JobWorkflow.run,
            JobInput(spec=spec),
            id=spec.job_id,
            task_queue=CONTROL_TASK_QUEUE,
            search_attributes=search_attributes(spec, "Pending"),
        )
        handle: WorkflowHandle[Any, Any] = env.client.get_workflow_handle(spec.job_id)
        first_run = (await handle.describe()).run_id
        while (await handle.query("describe", result_type=JobDescription)).tasks[0].attempt < restarts:
            await env.sleep(10)
        await handle.execute_update("cancel", result_type=Status)
        await run_result(handle)  # Canceled since protocol 2
        runs, run_id, events = 0, first_run, []
        while run_id:
            history = await env.client.get_workflow_handle(spec.job_id, run_id=run_id).fetch_history()
            runs += 1
            events.append(len(history.events))
            last = history.events[-1]
            attrs = last.workflow_execution_continued_as_new_event_attributes
            run_id = (
                attrs.new_execution_run_id
                if last.HasField("workflow_execution_continued_as_new_event_attributes")
                else ""
            )
    await env.shutdown()
    full = events[1:-1] or events
    per_run_restarts = restarts / max(len(events) - 1, 1)
    print(f"restarts: {restarts}  workflow runs (continue-as-new chain): {runs}")
    print(f"history events per workflow run: {events}")
    print(f"history events per restart: {sum(events) / restarts:.1f}")
    print(f"restarts per workflow run before continue-as-new: {per_run_restarts:.1f}")
    print(f"events of a full run vs the threshold: {max(full)} / {continue_as_new_events}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--restarts", type=int, default=300)
    parser.add_argument("--continue-as-new-events", type=int, default=4000)
    args = parser.parse_args()
    asyncio.run(measure(args.restarts, args.continue_as_new_events))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter finalization (see workers/cli.py main())


if __name__ == "__main__":
    main()
