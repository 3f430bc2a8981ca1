"""A placed worker is Pending until its machine picks it up (spec: Pending "placed, and its machine has not picked it
up yet"; Pending --> Preparing "placed, machine picks it up"), as `describe` and the history show it."""

from __future__ import annotations

from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fakes import Script, fake_cluster, unique
from tests.workflows.test_job_workflow import pairs, spec, start
from workers.outcomes import run_result
from workflows.contracts import node_task_queue
from workflows.domain.run.status import Status
from workflows.domain.run.views import JobDescription
from workflows.messages import AttemptsOnNode, AttemptsQuery, SchedulerView

AWAY = "n1"  # a machine whose agent does not poll yet


async def test_a_placed_worker_is_pending_until_its_machine_picks_it_up(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("pickup"))
    async with fake_cluster(time_skipping.client, Script(machines={"w-0": AWAY})) as cluster:
        handle = await start(time_skipping, job)
        for _ in range(100):
            described = await handle.query("describe", result_type=JobDescription)
            if described.tasks and described.tasks[0].node is not None:
                break
        task = described.tasks[0]
        assert (task.status.state, task.status.reason, task.node) == ("Pending", f"Placed on {AWAY}", AWAY)
        assert (described.status.state, described.status.reason) == ("Pending", f"Placed on {AWAY}")
        assert described.placement.nodes == []  # placed: no machine keeps it out
        # A scheduler that rebuilds its view reads it placed (not waiting), and its machine's fencing finds it.
        view = await handle.query("scheduler_view", result_type=SchedulerView)
        assert (view.pending, [(a.task_id, a.attempt, a.node) for a in view.placed]) == ([], [("w-0", 0, AWAY)])
        attempts = await handle.query("attempts_on", AttemptsQuery(node=AWAY), result_type=AttemptsOnNode)
        assert attempts == AttemptsOnNode(open=True, attempts={"w-0": 0})

        agent = [cluster.start_task, cluster.run_task, cluster.supervise_task, cluster.stop_task]
        async with Worker(time_skipping.client, task_queue=node_task_queue(AWAY), activities=agent):
            status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    history = described.tasks[0].history
    assert pairs(history) == [
        ("Pending", "Waiting for workers to start"),
        ("Pending", f"Placed on {AWAY}"),
        ("Preparing", f"Picked up by {AWAY}"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
        ("Completed", "Exited with code 0"),
    ]
    assert [e.at for e in history] == sorted(e.at for e in history)


async def test_a_worker_cancelled_before_its_machine_picked_it_up_is_cancelled_and_stopped_there(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("unpicked"))
    async with fake_cluster(time_skipping.client, Script(machines={"w-0": AWAY})) as cluster:
        handle = await start(time_skipping, job)
        for _ in range(100):
            described = await handle.query("describe", result_type=JobDescription)
            if described.tasks and described.tasks[0].node is not None:
                break
        await handle.execute_update("cancel", result_type=Status)
        for _ in range(100):  # Cancelled at once, its machine not answering yet
            described = await handle.query("describe", result_type=JobDescription)
            if described.tasks[0].status.state == "Cancelled":
                break
        cancelled = [("Pending", f"Placed on {AWAY}"), ("Cancelled", "Run cancelled")]
        assert pairs(described.tasks[0].history)[-2:] == cancelled
        agent = [cluster.start_task, cluster.run_task, cluster.supervise_task, cluster.stop_task]
        async with Worker(time_skipping.client, task_queue=node_task_queue(AWAY), activities=agent):
            status = await run_result(handle)  # closes once its machine confirmed the stop
    assert (status.state, status.reason) == ("Cancelled", "All workers ended; some were cancelled")
    assert cluster.released == [("w-0", 0)]
    assert "w-0.0" in cluster.stopped  # its machine was told to stop it
    assert not [s for s in cluster.starts if s.ref.task_id == "w-0"]  # and never started it
