"""Restarts, liveness, time limits and preemption of JobWorkflow, on the time-skipping test server.

Timers the workflow waits on alone (back-offs) pass in virtual time; those that run while an activity is in flight
(the stale grace, a TTL, a time limit) use shrunk settings, since the test server only skips idle time."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster, pairs, unique
from workers.outcomes import run_result
from workflows.contracts import CONTROL_TASK_QUEUE, search_attributes
from workflows.domain.run.events import MachineHeard, MachineLost, Preempt
from workflows.domain.run.status import Status
from workflows.domain.run.views import JobDescription
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, parse_spec
from workflows.job import JobWorkflow
from workflows.messages import JobInput

QUICK = Settings(stale_grace_seconds=1, heartbeat_ttl_seconds=3)


def spec(name: str, replicas: int = 1, on_failure: str = "RestartTask", **group: Any) -> JobSpec:
    return parse_spec(
        {
            "name": name,
            "on_failure": on_failure,
            "groups": [{"name": "w", "replicas": replicas, "command": ["x"], **group}],
        }
    )


async def start(env: WorkflowEnvironment, job: JobSpec) -> WorkflowHandle[Any, Any]:
    await env.client.start_workflow(
        JobWorkflow.run,
        JobInput(spec=job),
        id=job.job_id,
        task_queue=CONTROL_TASK_QUEUE,
        search_attributes=search_attributes(job, "Pending"),
    )
    return env.client.get_workflow_handle_for(JobWorkflow.run, job.job_id)  # follows continue-as-new


async def until(handle: WorkflowHandle[Any, Any], check: Any, tries: int = 200) -> JobDescription:
    for _ in range(tries):
        described = await handle.query("describe", result_type=JobDescription)
        if check(described):
            return described
        await asyncio.sleep(0.05)
    raise AssertionError(f"never true; last: {described.status} {[t.status for t in described.tasks]}")


async def test_a_late_heartbeat_makes_a_worker_stale_and_a_heartbeat_brings_it_back(
    time_skipping: WorkflowEnvironment,
) -> None:
    """Runs from before protocol 7 watch each worker with a heartbeat of its own."""
    job = spec(unique("stale"), restart_policy="Never")
    async with fake_cluster(time_skipping.client, Script(silent={"w-0.0": 1}), QUICK, protocol=6) as cluster:
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert pairs(described.tasks[0].history)[-4:] == [
        ("Running", "Container running"),
        ("Stale", "Heartbeat lease expired"),
        ("Running", "Heartbeat received"),
        ("Completed", "Exited with code 0"),
    ]
    assert [reattach for _, _, reattach in cluster.supervisors] == [False, True]
    assert (status.state, status.reason) == ("Completed", "All workers completed")


async def test_no_heartbeat_for_the_ttl_makes_a_worker_down_and_fails_a_run_that_never_restarts(
    time_skipping: WorkflowEnvironment,
) -> None:
    """Runs from before protocol 7 watch each worker with a heartbeat of its own."""
    job = spec(unique("down"), restart_policy="Never")
    async with fake_cluster(time_skipping.client, Script(silent={"w-0.0": 99}), QUICK, protocol=6):
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert pairs(described.tasks[0].history)[-3:] == [
        ("Running", "Container running"),
        ("Stale", "Heartbeat lease expired"),
        ("Down", "No heartbeat for the worker's full TTL after going stale"),
    ]
    assert (status.state, status.reason) == (
        "Failed",
        "Worker w-0 was lost on n0: No heartbeat for the worker's full TTL after going stale",
    )


def heard(late: bool, new_agent: bool = False, node: str = "n0") -> MachineHeard:
    return MachineHeard(node=node, late=late, new_agent=new_agent, at=datetime.now(UTC))


async def test_a_late_machine_makes_its_running_workers_stale_and_heard_again_brings_them_back(
    time_skipping: WorkflowEnvironment,
) -> None:
    """Protocol 7: the machine's lease carries its workers' liveness; a worker's watch has no heartbeat."""
    job = spec(unique("late"))
    async with fake_cluster(time_skipping.client, Script(hold={"w-0"}), QUICK) as cluster:
        handle = await start(time_skipping, job)
        await until(handle, lambda d: d.status.state == "Running")
        await handle.signal("machine_heard", heard(late=True, node="n1"))  # another machine: nothing here
        await handle.signal("machine_heard", heard(late=True))
        await until(handle, lambda d: d.tasks[0].status.state == "Stale")
        await handle.signal("machine_heard", heard(late=False))
        await until(handle, lambda d: d.tasks[0].status.state == "Running")
        await handle.execute_update("cancel")
        await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert pairs(described.tasks[0].history)[-5:] == [
        ("Running", "Container running"),
        ("Stale", "Heartbeat lease expired"),
        ("Running", "Heartbeat received"),
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]
    assert cluster.supervisors == [("w-0", 0, False), ("w-0", 0, True)]  # attached again once heard back


async def test_a_new_agent_of_the_machine_gets_the_watches_of_its_workers_again(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("newagent"))
    async with fake_cluster(time_skipping.client, Script(hold={"w-0"}), QUICK) as cluster:
        handle = await start(time_skipping, job)
        await until(handle, lambda d: d.status.state == "Running")
        await handle.signal("machine_heard", heard(late=False, new_agent=True))
        for _ in range(200):
            if len(cluster.supervisors) == 2:
                break
            await asyncio.sleep(0.05)
        await handle.execute_update("cancel")
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert cluster.supervisors == [("w-0", 0, False), ("w-0", 0, True)]
    assert pairs(described.tasks[0].history)[-3:] == [
        ("Running", "Container running"),
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]
    assert status.state == "Cancelled"


async def test_a_machine_late_for_a_workers_ttl_makes_it_down_and_it_restarts_once_its_copy_surely_stopped(
    time_skipping: WorkflowEnvironment,
) -> None:
    """Its worker's TTL (3 s) is shorter than the machine's lease (5 s): Down before the machine is lost, and started
    again only after the machine's agent surely stopped it (its fence counts from the lease's last renewal, 1 s of
    grace before it went late: 10 - 1 + 1 + 1 s after), not after its back-off (1 s)."""
    job = spec(unique("latettl"))
    settings = Settings(
        stale_grace_seconds=1,
        heartbeat_ttl_seconds=3,
        node_lease_ttl_seconds=5,
        fence_after_seconds=10,
        stop_grace_seconds=1,
        clock_skew_seconds=1,
        backoff_base_seconds=1,
    )
    async with fake_cluster(time_skipping.client, Script(hold={"w-0.0"}), settings):
        handle = await start(time_skipping, job)
        described = await until(handle, lambda d: d.status.state == "Running")
        # On the test server's clock, which earlier tests moved ahead of this one's
        late = MachineHeard(node="n0", late=True, at=described.tasks[0].history[-1].at)
        await handle.signal("machine_heard", late)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    fence = late.at + timedelta(seconds=11)
    waits = f"Restarts at {fence:%Y-%m-%d %H:%M:%S} UTC, once its copy on n0 has surely stopped"
    assert pairs(described.tasks[0].history)[4:9] == [
        ("Running", "Container running"),
        ("Stale", "Heartbeat lease expired"),
        ("Down", "No heartbeat for the worker's full TTL after going stale"),
        ("Down", waits),
        ("Pending", "Restarted by policy (restart 1/10)"),
    ]
    assert (status.state, status.reason) == ("Completed", "All workers completed")


async def test_a_run_from_before_protocol_7_leaves_machine_heard_to_its_own_heartbeats(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("oldheard"))
    async with fake_cluster(time_skipping.client, Script(hold={"w-0"}), QUICK, protocol=6) as cluster:
        handle = await start(time_skipping, job)
        await until(handle, lambda d: d.status.state == "Running")
        await handle.signal("machine_heard", heard(late=True, new_agent=True))
        await handle.execute_update("cancel")
        await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert "Stale" not in [state for state, _ in pairs(described.tasks[0].history)]
    assert cluster.supervisors == [("w-0", 0, False)]


async def test_a_lost_machine_takes_its_workers_down_and_they_restart_by_policy(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("lost"))
    async with fake_cluster(time_skipping.client, Script(hold={"w-0.0"})):
        handle = await start(time_skipping, job)
        await until(handle, lambda d: d.status.state == "Running")
        await handle.signal("machine_lost", MachineLost(node="n0"))
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    history = pairs(described.tasks[0].history)
    assert history[5:8] == [
        ("Down", "Machine lost: its lease expired"),
        ("Pending", "Restarted by policy (restart 1/10)"),
        ("Pending", "Placed on n0"),
    ]
    assert described.tasks[0].restarts == 1
    assert (status.state, status.reason) == ("Completed", "All workers completed")


async def test_a_late_report_of_a_loss_before_the_worker_started_leaves_it_running(
    time_skipping: WorkflowEnvironment,
) -> None:
    """Chaos run-0019: the machine was lost, came back, and its new agent started the worker; the report of the
    loss, dated before that start, reaches the run only then. The worker is not counted lost (nor run twice)."""
    job = spec(unique("lostgen"))
    async with fake_cluster(time_skipping.client, Script(hold={"w-0.0"})) as cluster:
        handle = await start(time_skipping, job)
        described = await until(handle, lambda d: d.status.state == "Running")
        started = next(e.at for e in described.tasks[0].history if e.state == "Starting")
        stale = MachineLost(node="n0", lost_at=started - timedelta(seconds=1))
        await handle.signal("machine_lost", stale)
        await handle.execute_update("cancel")  # decided after the signal, in its order
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert pairs(described.tasks[0].history)[-4:] == [
        ("Starting", "Container started"),
        ("Running", "Container running"),
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]
    assert (described.tasks[0].attempt, described.tasks[0].restarts) == (0, 0)
    assert [attempt for _, attempt, _ in cluster.supervisors] == [0]
    assert status.state == "Cancelled"


async def test_a_worker_past_its_time_limit_is_stopped_and_fails_the_run(time_skipping: WorkflowEnvironment) -> None:
    job = parse_spec(
        {
            "name": unique("limit"),
            "groups": [
                {"name": "w", "command": ["x"], "time_limit_seconds": 1},
                {"name": "v", "command": ["x"]},
            ],
        }
    )
    async with fake_cluster(time_skipping.client, Script(hold={"w-0", "v-0"})):
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    first, second = described.tasks
    assert pairs(first.history)[-2:] == [
        ("Stopping", "Exceeded its time limit of 1s"),
        ("Cancelled", "Stopped on request"),
    ]
    assert (status.state, status.reason) == ("Failed", "Worker w-0: Exceeded its time limit of 1s")
    assert pairs(second.history)[-2:] == [
        ("Stopping", "A worker exceeded its time limit"),
        ("Cancelled", "Stopped on request"),
    ]
    assert first.restarts == 0  # never restarted


async def test_a_preempted_worker_is_queued_again_without_spending_its_budget(
    time_skipping: WorkflowEnvironment,
) -> None:
    job = spec(unique("preempted"))
    async with fake_cluster(time_skipping.client, Script(hold={"w-0.0"})):
        handle = await start(time_skipping, job)
        await until(handle, lambda d: d.status.state == "Running")
        await handle.signal("preempt", Preempt(task_ids=["w-0"], by="urgent-eval"))
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    task = described.tasks[0]
    assert pairs(task.history)[5:9] == [
        ("Stopping", "Preempted by higher-priority work (urgent-eval)"),
        ("Cancelled", "Stopped on request"),
        ("Pending", "Preempted by urgent-eval; queued again"),
        ("Pending", "Placed on n0"),
    ]
    assert ("Pending", "Preempted by higher-priority work (urgent-eval); waiting to run again") in pairs(
        described.history
    )
    assert (task.restarts, task.attempt) == (0, 1)
    assert (status.state, status.reason) == ("Completed", "All workers completed")


async def test_restart_task_restarts_only_the_failed_worker(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("task"), replicas=2)
    script = Script(exits={"w-0": [3, 0]}, hold={"w-1.0"}, hold_exit=0)
    async with fake_cluster(time_skipping.client, script) as cluster:
        handle = await start(time_skipping, job)
        await until(handle, lambda d: d.tasks and d.tasks[0].attempt == 1 and d.tasks[0].status.state == "Completed")
        cluster.stopped.setdefault("w-1.0", asyncio.Event()).set()  # w-1 ends on its own, exit 0
        await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert ("Pending", "Restarted by policy (restart 1/10)") in pairs(described.tasks[0].history)
    assert described.tasks[1].attempt == 0


async def test_restart_job_requeues_every_worker(time_skipping: WorkflowEnvironment) -> None:
    job = spec(unique("job"), replicas=2, on_failure="RestartJob")
    async with fake_cluster(time_skipping.client, Script(exits={"w-0": [3, 0]}, hold={"w-1.0"})):
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    failed, other = described.tasks
    assert ("Pending", "Gang restart: w-0 failed") in pairs(failed.history)
    stopping = pairs(other.history).index(("Stopping", "Gang restart: w-0 failed"))
    assert pairs(other.history)[stopping : stopping + 3] == [
        ("Stopping", "Gang restart: w-0 failed"),
        ("Cancelled", "Stopped on request"),
        ("Pending", "Gang restart: w-0 failed"),
    ]
    failed_at = next(e.at for e in failed.history if e.state == "Failed")
    requeued = [e.at for e in other.history if e.state == "Pending"][-1]
    assert requeued == [e.at for e in failed.history if e.state == "Pending"][-1]  # together, in one decision
    assert requeued - failed_at >= timedelta(seconds=10)  # after the failed one's back-off
    assert (failed.restarts, other.restarts) == (1, 0)
    assert (status.state, status.reason) == ("Completed", "All workers completed")


async def test_a_long_lived_run_continues_as_new_and_keeps_its_history_readable(
    own_time_skipping: WorkflowEnvironment,
) -> None:
    time_skipping = own_time_skipping  # a server of its own: others' activities in flight would stop time skipping
    job = spec(unique("forever"), restart_policy="Always")
    settings = Settings(continue_as_new_events=200, history_keep=30)
    async with fake_cluster(time_skipping.client, Script(), settings):
        handle = await start(time_skipping, job)
        first_run = (await handle.describe()).run_id
        for _ in range(400):  # time skips only while the test server is asked to wait
            await time_skipping.sleep(10)
            described = await handle.query("describe", result_type=JobDescription)
            if described.tasks and described.tasks[0].attempt >= 200:
                break
        await handle.execute_update("cancel", result_type=Status)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
        last_run = (await handle.describe()).run_id
        first = await time_skipping.client.get_workflow_handle(job.job_id, run_id=first_run).fetch_history()
    assert last_run != first_run
    assert first.events[-1].HasField("workflow_execution_continued_as_new_event_attributes")
    assert len(first.events) < 260  # it continued as new near continue_as_new_events (200)
    assert (status.state, status.reason) == ("Cancelled", "All workers ended; some were cancelled")
    task = described.tasks[0]
    assert task.attempt >= 200  # hundreds of restarts
    assert len(task.history) <= 30
    summary = task.history[3]
    assert summary.code == "HistorySummarised"
    assert summary.reason.split()[0].isdigit() and int(summary.reason.split()[0]) >= 200 * 5 - 30
