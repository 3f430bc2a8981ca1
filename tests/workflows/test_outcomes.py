"""The Temporal UI's buttons are safe, and its badges tell the truth: a cancellation request (Request Cancellation,
`WorkflowHandle.cancel()`) is `astraeus cancel`; a Failed run's workflow fails, a Cancelled one's is Canceled, a
Completed one's completes; and the client still reads every run's Status. In virtual time, with fake agents."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError
from temporalio.exceptions import ApplicationError, CancelledError
from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster, unique
from tests.workflows.test_job_workflow import pairs, spec, start
from workers.client import AstraeusClient
from workers.outcomes import run_result
from workflows.domain.run.status import Status
from workflows.domain.run.views import JobDescription

PATIENCE = 60  # seconds of real time before a test gives up on a run that never closes


async def until_running(handle, reason: str = "1 of 2 workers running") -> None:  # type: ignore[no-untyped-def]
    for _ in range(200):
        if (await handle.query("status", result_type=Status)).reason == reason:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the run never read {reason!r}")


async def test_a_cancellation_request_stops_the_workers_and_ends_the_run_cancelled(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("ui-cancel"), replicas=2)
    # w-0 runs until stopped, and its stop takes a while: long enough for a cancellation to reach it if it were sent.
    script = Script(hold={"w-0"}, no_room={"w-1"}, stop_seconds=1.0)
    async with fake_cluster(time_skipping.client, script) as cluster:
        handle = await start(time_skipping, job)
        await until_running(handle)
        await handle.cancel()  # what the UI's Request Cancellation button sends
        status = await asyncio.wait_for(run_result(handle), PATIENCE)
        described = await handle.query("describe", result_type=JobDescription)
        closed = (await handle.describe()).status
        history = await handle.fetch_history()
    assert (status.state, status.reason) == ("Cancelled", "All workers ended; some were cancelled")
    assert pairs(described.tasks[0].history)[-2:] == [
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]
    assert pairs(described.tasks[1].history)[-2:] == [
        ("Pending", "No machine fits: 1 of 1 machines ready"),
        ("Cancelled", "Run cancelled"),
    ]
    assert pairs(described.history)[-1] == ("Cancelled", "All workers ended; some were cancelled")
    assert cluster.stopped["w-0.0"].is_set()
    # The stop the run started after the request ran to its end: no activity of the run was cancelled.
    assert cluster.stops_cancelled == []
    assert [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_CANCEL_REQUESTED] == []
    assert sorted(cluster.released) == [("w-0", 0), ("w-1", 0)]
    assert closed == WorkflowExecutionStatus.CANCELED


async def test_a_cancellation_request_to_a_waiting_run_ends_it_at_once(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("ui-cancel-pending"))
    async with fake_cluster(time_skipping.client, Script(no_room={"w-0"})):
        handle = await start(time_skipping, job)
        await until_running(handle, "No machine fits: 1 of 1 machines ready")
        await handle.cancel()
        status = await asyncio.wait_for(run_result(handle), PATIENCE)
        described = await handle.query("describe", result_type=JobDescription)
        closed = (await handle.describe()).status
    assert (status.state, status.reason) == ("Cancelled", "All workers ended; some were cancelled")
    assert pairs(described.tasks[0].history)[-1] == ("Cancelled", "Run cancelled")
    assert closed == WorkflowExecutionStatus.CANCELED


async def test_a_failed_runs_workflow_fails_with_its_status_and_the_client_still_reads_it(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("failing"), restart_policy="Never")
    reason = "Worker w-0 failed on n0: Exited with code 3"
    async with fake_cluster(time_skipping.client, Script(exits={"w-0": [3]})):
        handle = await start(time_skipping, job)
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), PATIENCE)
        closed = (await handle.describe()).status
        client = AstraeusClient(time_skipping.client)
        result = await client.result(job.namespace, job.name)
        status = await client.status(job.namespace, job.name)
    completing = spec(unique("completing"))  # and a run that completes: its workflow returns its Status
    async with fake_cluster(time_skipping.client, Script()):
        completed = await start(time_skipping, completing)
        returned = await asyncio.wait_for(completed.result(), PATIENCE)
        completed_closed = (await completed.describe()).status
        completed_result = await client.result(completing.namespace, completing.name)
    cause = failed.value.cause
    assert isinstance(cause, ApplicationError)
    assert (cause.type, cause.message, cause.non_retryable) == ("RunFailed", reason, True)
    assert Status.model_validate(cause.details[0]) == result
    assert closed == WorkflowExecutionStatus.FAILED
    assert (result.state, result.reason, result.code) == ("Failed", reason, "WorkerFailed")
    assert status == result
    assert completed_closed == WorkflowExecutionStatus.COMPLETED
    assert (returned.state, returned.reason) == ("Completed", "All workers completed")
    assert completed_result == returned


async def test_a_run_cancelled_with_astraeus_cancel_ends_its_workflow_canceled(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("cancelled"), replicas=2)
    async with fake_cluster(time_skipping.client, Script(hold={"w-0"}, no_room={"w-1"})):
        handle = await start(time_skipping, job)
        await until_running(handle)
        client = AstraeusClient(time_skipping.client)
        await client.cancel(job.namespace, job.name)  # the `cancel` update: nobody asked Temporal to cancel
        with pytest.raises(WorkflowFailureError) as cancelled:
            await asyncio.wait_for(handle.result(), PATIENCE)
        closed = (await handle.describe()).status
        result = await client.result(job.namespace, job.name)
        status = await client.status(job.namespace, job.name)
    assert isinstance(cancelled.value.cause, CancelledError)
    assert closed == WorkflowExecutionStatus.CANCELED
    assert (result.state, result.reason) == ("Cancelled", "All workers ended; some were cancelled")
    assert status == result
