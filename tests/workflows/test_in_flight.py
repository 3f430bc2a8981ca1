"""Protocol 6 through JobWorkflow, on the time-skipping test server: the workflow keeps what is in flight by
identity and runs the difference from what the record needs after each decision (workflows/domain/run/effects.py), so
a timer the record no longer needs is cancelled, where a run of protocol 5 leaves it armed until the run closes."""

from __future__ import annotations

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster, pairs, unique
from tests.workflows.test_liveness import spec, start, until
from workers.outcomes import run_result
from workflows.domain.run.views import JobDescription
from workflows.messages import StopTaskRequest


@pytest.mark.parametrize("protocol", [5, 6], ids=["protocol 5 leaves it armed", "protocol 6 cancels it"])
async def test_the_time_limit_timer_of_a_worker_that_stopped_is_cancelled_since_protocol_6(
    time_skipping: WorkflowEnvironment, protocol: int
) -> None:
    """w-0 runs with a time limit of an hour (its timer armed), then is stopped on request and ends: the record no
    longer needs the timer."""
    job = spec(unique(f"limitcancel{protocol}"), time_limit_seconds=3600)
    async with fake_cluster(time_skipping.client, Script(hold={"w-0"}), protocol=protocol):
        handle = await start(time_skipping, job)
        await until(handle, lambda d: d.tasks and d.tasks[0].status.state == "Running")
        await handle.execute_update("stop_task", StopTaskRequest(task_id="w-0"))
        await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
        history = await handle.fetch_history()
    assert pairs(described.tasks[0].history)[-1][0] in ("Cancelled", "Failed", "Completed")
    kinds = [EventType.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in history.events]
    assert kinds.count("TIMER_STARTED") == 1, kinds  # the time limit, armed as the worker ran
    assert kinds.count("TIMER_FIRED") == 0, kinds
    assert kinds.count("TIMER_CANCELED") == (1 if protocol >= 6 else 0), kinds
