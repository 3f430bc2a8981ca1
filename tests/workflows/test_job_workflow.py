"""JobWorkflow in virtual time on the time-skipping test server, with fake scheduler and agent activities."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowHandle, WorkflowQueryFailedError, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from tests.workflows.fakes import Script, fake_cluster, pairs, unique
from workers.client import AstraeusClient
from workers.errors import AstraeusError
from workers.outcomes import run_result
from workflows import contracts
from workflows.contracts import CONTROL_TASK_QUEUE, search_attributes
from workflows.domain.run.events import Created, PlacementUpdate, TaskStarted
from workflows.domain.run.job import decide
from workflows.domain.run.status import Status
from workflows.domain.run.tasks import new_job
from workflows.domain.run.views import JobDescription
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, parse_spec
from workflows.job import JobWorkflow
from workflows.messages import JobInput, StopTaskRequest


def spec(name: str, replicas: int = 1, **group: object) -> JobSpec:
    return parse_spec({"name": name, "groups": [{"name": "w", "replicas": replicas, "command": ["x"], **group}]})


async def start(env: WorkflowEnvironment, job: JobSpec, task_timeout: timedelta | None = None):  # type: ignore[no-untyped-def]
    return await env.client.start_workflow(
        JobWorkflow.run,
        JobInput(spec=job),
        id=job.job_id,
        task_queue=CONTROL_TASK_QUEUE,
        search_attributes=search_attributes(job, "Pending"),
        task_timeout=task_timeout,  # None: Temporal's default (10 s)
    )


async def test_two_workers_complete_with_the_specs_reasons(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("hello"), replicas=2)
    async with fake_cluster(time_skipping.client, Script()) as cluster:
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    assert pairs(described.history)[:3] == [
        ("Pending", "Run created"),
        ("Pending", "Waiting for workers to be created"),
        ("Pending", "Waiting for workers to start"),
    ]
    assert ("Running", "2 of 2 workers running") in pairs(described.history) or (
        "Running",
        "1 of 2 workers running",
    ) in pairs(described.history)
    assert pairs(described.history)[-1] == ("Completed", "All workers completed")
    assert pairs(described.tasks[0].history) == [
        ("Pending", "Waiting for workers to start"),
        ("Pending", "Placed on n0"),
        ("Preparing", "Picked up by n0"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
        ("Completed", "Exited with code 0"),
    ]
    assert sorted(cluster.released) == [("w-0", 0), ("w-1", 0)]


async def test_a_worker_that_exits_3_fails_the_run_and_keeps_its_log(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("fail"), restart_policy="Never")
    async with fake_cluster(time_skipping.client, Script(exits={"w-0": [3]}, log_tail="boom\n")):
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Failed", "Worker w-0 failed on n0: Exited with code 3")
    failure = described.tasks[0].last_failure
    assert failure is not None
    assert (failure.exit_code, failure.reason, failure.log_tail) == (3, "Exited with code 3", "boom\n")


async def test_back_off_ladder_and_budget_in_virtual_time(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("ladder"))
    async with fake_cluster(time_skipping.client, Script(exits={"w-0": [3]})):
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == (
        "Failed",
        "Worker w-0 failed on n0: Retry budget exhausted after 10/10 restarts",
    )
    history = described.tasks[0].history
    failed_at = [e.at for e in history if (e.state, e.reason) == ("Failed", "Exited with code 3")]
    restarted = [e for e in history if e.state == "Pending" and e.reason.startswith("Restarted")]
    assert [e.reason for e in restarted] == [f"Restarted by policy (restart {i}/10)" for i in range(1, 11)]
    waits = [round((r.at - f).total_seconds()) for f, r in zip(failed_at, restarted, strict=False)]
    assert waits == [10, 20, 40, 80, 160, 300, 300, 300, 300, 300]
    assert pairs(history)[-1] == ("Failed", "Retry budget exhausted after 10/10 restarts")
    assert described.tasks[0].restarts == 10


async def test_restart_at_is_shown_while_a_worker_waits(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("waits"))
    async with fake_cluster(time_skipping.client, Script(exits={"w-0": [3, 0]})):
        handle = await start(time_skipping, job)
        await time_skipping.sleep(0)  # let it fail once
        for _ in range(50):
            described = await handle.query("describe", result_type=JobDescription)
            if described.tasks and described.tasks[0].restart_at:
                break
        task = described.tasks[0]
        assert task.restart_at is not None
        assert task.restart_at - task.status.finished_at == timedelta(seconds=10)  # type: ignore[operator]
        status = await run_result(handle)
    assert (status.state, status.reason) == ("Completed", "All workers completed")


async def test_cancel_stops_running_and_waiting_workers(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("cancel"), replicas=2)
    script = Script(hold={"w-0"}, no_room={"w-1"})
    async with fake_cluster(time_skipping.client, script):
        handle = await start(time_skipping, job)
        for _ in range(100):
            if (await handle.query("status", result_type=Status)).state == "Running":
                break
        await handle.execute_update("cancel", result_type=Status)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Cancelled", "All workers ended; some were cancelled")
    assert pairs(described.tasks[0].history)[-2:] == [
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]
    assert pairs(described.tasks[1].history)[-2:] == [
        ("Pending", "No machine fits: 1 of 1 machines ready"),
        ("Cancelled", "Run cancelled"),
    ]
    with pytest.raises(RPCError):  # the run is closed: nothing to cancel
        await handle.execute_update("cancel", result_type=Status)


async def test_stop_one_worker_and_refuse_bad_stops(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("stop"), replicas=2)
    async with fake_cluster(time_skipping.client, Script(hold={"w-0", "w-1"})):
        handle = await start(time_skipping, job)
        for _ in range(100):
            if (await handle.query("status", result_type=Status)).reason == "2 of 2 workers running":
                break
        with pytest.raises(WorkflowUpdateFailedError) as unknown:
            await handle.execute_update("stop_task", StopTaskRequest(task_id="w-9"), result_type=Status)
        assert unknown.value.cause.message == f"run {job.namespace}/{job.name} has no worker w-9"
        await handle.execute_update("stop_task", StopTaskRequest(task_id="w-0"), result_type=Status)
        await handle.execute_update(
            "stop_task", StopTaskRequest(task_id="w-1", reason="Making room for a demo"), result_type=Status
        )
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
        with pytest.raises(RPCError):  # the run is closed: its workers ended
            await handle.execute_update("stop_task", StopTaskRequest(task_id="w-0"), result_type=Status)
    assert pairs(described.tasks[0].history)[-2:] == [
        ("Stopping", "Stopped by scheduler"),
        ("Cancelled", "Stopped on request"),
    ]
    assert pairs(described.tasks[1].history)[-2:] == [
        ("Stopping", "Making room for a demo"),
        ("Cancelled", "Stopped on request"),
    ]
    assert (status.state, status.reason) == ("Cancelled", "All workers ended; some were cancelled")


async def test_a_run_placed_apart_from_its_settings_calls_place_itself(time_skipping: WorkflowEnvironment) -> None:
    """Histories before load_settings placed a run's first workers have no requests in its result: the run asks
    `place` itself, and replays as it ran."""
    async with fake_cluster(time_skipping.client, Script(place_apart=True)) as cluster:
        handle = await start(time_skipping, spec(unique("apart")))
        status = await run_result(handle)
        history = await handle.fetch_history()
    markers = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    assert len(markers) == 3  # load_settings, place, release
    assert cluster.released == [("w-0", 0)]


async def test_what_load_settings_asked_and_the_first_decision_did_not_is_given_back(
    time_skipping: WorkflowEnvironment,
) -> None:
    """load_settings asks the scheduler for the first decision's workers; what that decision does not ask (as when
    a cancellation came first and the run asks for nothing) is given back, and the rest is taken as answered."""
    async with fake_cluster(time_skipping.client, Script(admit_also="w-9")) as cluster:
        handle = await start(time_skipping, spec(unique("give-back")))
        status = await run_result(handle)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    assert sorted(cluster.released) == [("w-0", 0), ("w-9", 0)]
    assert cluster.placed == [["w-0", "w-9"]]  # by load_settings alone


async def test_a_run_whose_settings_outlast_a_workflow_task_replays_as_it_ran(
    time_skipping: WorkflowEnvironment,
) -> None:
    """load_settings (with the scheduler's first answers) takes longer than 80% of the workflow task's timeout: the
    SDK completes that task empty to keep it alive, and a replay takes it as one with the next, its workflow.now()
    later. The first decision is taken at the time load_settings recorded, so the replay takes the same answers."""
    job = spec(unique("late-settings"))
    # The SDK completes the task after 1.6 s of the 2 s; load_settings answers 0.2 s later, in the next task.
    async with fake_cluster(time_skipping.client, Script(settings_seconds=1.8)) as cluster:
        handle = await start(time_skipping, job, task_timeout=timedelta(seconds=2))
        status = await run_result(handle)
        history = await handle.fetch_history()
    kinds = [e.event_type for e in history.events]
    settings_marker = kinds.index(EventType.EVENT_TYPE_MARKER_RECORDED)  # its task's completion comes just before
    replayer = Replayer(workflows=[JobWorkflow], data_converter=pydantic_data_converter)
    replayed = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED in kinds[: settings_marker - 1]  # a task completed empty
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    assert cluster.placed == [["w-0"]]  # by load_settings alone
    assert replayed.replay_failure is None


class Creating:
    """A run's workflow as a query finds it before its first decision made its record (its first workflow task
    was kept alive past its timeout, or failed, on a busy cluster), `creating` times over; then Pending."""

    def __init__(self, creating: int, error: str = contracts.BEING_CREATED) -> None:
        self.creating, self.error, self.asked = creating, error, 0

    async def query(self, name: str, *args: object, result_type: type) -> Status:
        self.asked += 1
        if self.asked <= self.creating:
            raise WorkflowQueryFailedError(self.error)
        return Status(state="Pending", reason="Run created", code="RunCreated", created_at=datetime.now(UTC))


async def test_a_run_read_before_it_made_its_record_is_asked_again_until_it_has(
    time_skipping: WorkflowEnvironment,
) -> None:
    client = AstraeusClient(time_skipping.client)
    creating = Creating(3)
    status = await client._ask(cast(WorkflowHandle[Any, Any], creating), "default", "new", contracts.STATUS)
    assert (status.state, creating.asked) == ("Pending", 4)
    broken = Creating(1, error="the query handler failed")
    with pytest.raises(AstraeusError) as refused:
        await client._ask(cast(WorkflowHandle[Any, Any], broken), "default", "new", contracts.STATUS)
    assert (str(refused.value), broken.asked) == ("run default/new: the query handler failed", 1)


class EndsEmpty:
    """A workflow handle whose wait for the close event ends empty `times` times (the time-skipping test server's
    long poll), then gives the run's result."""

    def __init__(self, times: int) -> None:
        self.times, self.waited = times, 0

    async def result(self) -> dict[str, Any]:
        self.waited += 1
        if self.waited <= self.times:
            raise RuntimeError("No completion event found")
        return Status(
            state="Completed", reason="All workers completed", code="RunCompleted", created_at=datetime.now(UTC)
        ).model_dump()


async def test_a_wait_for_a_runs_end_that_ends_empty_waits_again() -> None:
    handle = EndsEmpty(2)
    status = await run_result(cast(WorkflowHandle[Any, Any], handle))
    assert (status.state, handle.waited) == ("Completed", 3)


@pytest.mark.parametrize("protocol", [5, 6])
async def test_a_one_worker_run_costs_one_activity_one_signal_and_at_most_20_events(
    time_skipping: WorkflowEnvironment, protocol: int
) -> None:
    """Protocol 3 on: the scheduler's `place` and `release` are local activities (one marker each, in a workflow
    task the run has anyway); one activity (run_task) starts and watches the worker, telling the run once that it
    was started and runs; only the state's search attribute is written, when it changes. Protocol 6, which runs
    the difference from what is in flight after each decision, writes no more."""
    job = spec(unique(f"cheap{protocol}"))
    async with fake_cluster(time_skipping.client, Script(), protocol=protocol) as cluster:
        handle = await start(time_skipping, job)
        await handle.result()
        history = await handle.fetch_history()
    events = history.events
    kinds = [EventType.Name(e.event_type).removeprefix("EVENT_TYPE_") for e in events]
    scheduled = [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]
    signals = [
        e.workflow_execution_signaled_event_attributes.signal_name
        for e in events
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
    ]
    markers = [e for e in events if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    upserts = [e for e in events if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES]
    assert scheduled == ["run_task"]
    assert signals == ["task_running"]
    assert len(markers) == 2  # load_settings (the first placement too), release
    assert cluster.released == [("w-0", 0)]
    assert len(upserts) == 2  # Running, then Completed
    assert kinds.count("WORKFLOW_TASK_COMPLETED") == 3, kinds  # created and placed; running; ended and released
    assert len(events) == 19, kinds


async def test_a_run_whose_events_cannot_be_decided_fails_and_stops_its_workers(
    time_skipping: WorkflowEnvironment,
) -> None:
    """A record the core cannot decide (here: a worker of a group its spec no longer has, as a record carried
    across a change of the core might be) fails its run instead of failing the workflow task for ever."""
    name = unique("undecidable")
    both = parse_spec(
        {
            "name": name,
            "groups": [
                {"name": "w", "command": ["x"], "readiness": {"command": ["true"]}},
                {"name": "after", "command": ["x"], "depends_on": [{"group": "w", "condition": "healthy"}]},
            ],
        }
    )
    record = new_job(both, Settings(), datetime(2025, 1, 1, tzinfo=UTC))
    for events in (
        [Created()],
        [PlacementUpdate(task_id="w-0", attempt=0, node="n0")],
        [TaskStarted(task_id="w-0", attempt=0)],
    ):
        record, _ = decide(record, list(events), record.status.created_at)
    job = parse_spec({"name": name, "groups": [both.groups[0].model_dump()]})
    record = record.model_copy(update={"spec": job})  # after-0 waits, gated, for a group that is gone
    async with fake_cluster(time_skipping.client, Script(hold={"w-0"})):
        handle = await time_skipping.client.start_workflow(
            JobWorkflow.run,
            JobInput(spec=job, record=record),
            id=job.job_id,
            task_queue=CONTROL_TASK_QUEUE,
            search_attributes=search_attributes(job, "Pending"),
        )
        status = await asyncio.wait_for(handle.result(), 30)  # a failing workflow task would retry for ever
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason, status.code) == (
        "Failed",
        "Cannot be decided: StopIteration",
        "CannotBeDecided",
    )
    assert pairs(described.tasks[0].history)[-2:] == [("Stopping", "Run failed"), ("Cancelled", "Stopped on request")]
    assert pairs(described.tasks[1].history)[-1] == ("Cancelled", "Run failed")
