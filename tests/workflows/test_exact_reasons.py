"""Reasons exact to the letter (issue 14), read from a run's history through JobWorkflow in virtual time: a
preemption by another namespace, the rest of a run a failed worker ends, and a gang cancelled at the barrier."""

from __future__ import annotations

import asyncio

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster, unique
from tests.workflows.test_job_workflow import pairs, spec, start
from workers.outcomes import run_result
from workflows.domain.reasons import ANOTHER_NAMESPACE
from workflows.domain.run.events import Preempt
from workflows.domain.run.status import Status
from workflows.domain.run.views import JobDescription
from workflows.domain.spec import parse_spec


async def wait_until(handle: WorkflowHandle, check: str, attribute: str = "reason") -> None:  # type: ignore[type-arg]
    for _ in range(400):
        if getattr(await handle.query("status", result_type=Status), attribute) == check:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never read {check!r}")


async def test_a_run_preempted_by_another_namespace_names_it_in_parentheses_once(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("victim"))
    async with fake_cluster(time_skipping.client, Script(hold={"w-0.0"})):
        handle = await start(time_skipping, job)
        await wait_until(handle, "Running", "state")
        await handle.signal("preempt", Preempt(task_ids=["w-0"], by=ANOTHER_NAMESPACE))
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    history = pairs(described.tasks[0].history)
    assert ("Stopping", "Preempted by higher-priority work (a job in another namespace)") in history
    assert ("Pending", "Preempted by (a job in another namespace); queued again") in history
    assert (
        "Pending",
        "Preempted by higher-priority work (a job in another namespace); waiting to run again",
    ) in pairs(described.history)
    assert not any("((" in reason for _, reason in history + pairs(described.history))


async def test_the_rest_of_a_run_a_failed_worker_ends_are_stopped_with_the_specs_reason(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("fails"), replicas=2, restart_policy="Never")
    async with fake_cluster(time_skipping.client, Script(exits={"w-0": [3]}, hold={"w-1"}, after={"w-0": "w-1"})):
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Failed", "Worker w-0 failed on n0: Exited with code 3")
    assert pairs(described.tasks[1].history)[-2:] == [
        ("Stopping", "A worker failed, and the run fails on a failure"),
        ("Cancelled", "Stopped on request"),
    ]


async def test_a_gang_cancelled_at_the_barrier_goes_from_starting_to_cancelled(
    own_time_skipping: WorkflowEnvironment,
) -> None:
    group = {"name": "w", "replicas": 2, "command": ["x"]}
    job = parse_spec({"name": unique("barrier"), "gang": True, "groups": [group]})
    async with fake_cluster(own_time_skipping.client, Script(late={"w-1"})):
        handle = await start(own_time_skipping, job)
        await wait_until(handle, "Starting together: 1 of 2 ready")
        await handle.execute_update("cancel", result_type=Status)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Cancelled", "All workers ended; some were cancelled")
    # The diagram has no Starting --> Cancelled edge: workflows/README.md says why a gang takes it.
    assert pairs(described.history)[-2:] == [
        ("Starting", "Starting together: 1 of 2 ready"),
        ("Cancelled", "All workers ended; some were cancelled"),
    ]
    assert pairs(described.tasks[0].history)[-3:] == [
        ("ReadyToStart", "Waiting at the gang barrier"),
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]
