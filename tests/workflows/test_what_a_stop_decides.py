"""Through JobWorkflow, on the time-skipping test server: a time limit's timer that fires after its attempt ended
fails nothing, and a worker stopping for a gang restart when its run is cancelled is not shown restarting
(tests/domain/test_what_a_stop_decides.py has the decisions)."""

from __future__ import annotations

from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster, pairs, unique
from tests.workflows.test_liveness import spec, start, until
from workers.outcomes import run_result
from workflows.domain.run.status import Status
from workflows.domain.run.views import JobDescription


async def test_a_time_limit_passing_during_the_back_off_does_not_fail_the_restarted_worker_that_completes(
    time_skipping: WorkflowEnvironment,
) -> None:
    """w-0 fails at once; its 5 s limit passes during its 10 s back-off (virtual time); attempt 1 exits 0."""
    job = spec(unique("limitbackoff"), time_limit_seconds=5)
    async with fake_cluster(time_skipping.client, Script(exits={"w-0": [3, 0]})):
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    task = described.tasks[0]
    assert (task.attempt, task.restarts) == (1, 1)
    assert pairs(task.history)[-1] == ("Completed", "Exited with code 0")
    assert (status.state, status.reason) == ("Completed", "All workers completed")


async def test_a_worker_stopping_for_a_gang_restart_when_the_run_is_cancelled_ends_without_a_restart(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("restartcancel"), replicas=2, on_failure="RestartJob")
    script = Script(exits={"w-0": [3]}, hold={"w-1"}, stop_seconds=1)
    async with fake_cluster(time_skipping.client, script):
        handle = await start(time_skipping, job)
        await until(handle, lambda d: d.tasks and d.tasks[1].status.state == "Stopping")
        await handle.execute_update("cancel", result_type=Status)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Cancelled", "All workers ended; some were cancelled")
    stopped = described.tasks[1]
    assert pairs(stopped.history)[-2:] == [
        ("Stopping", "Gang restart: w-0 failed"),
        ("Cancelled", "Stopped on request"),
    ]
    assert [t.restart_at for t in described.tasks] == [None, None]
