"""Gang runs through JobWorkflow in virtual time: the barrier (two start calls per member), its timeout, and
the environment that lets members find each other."""

from __future__ import annotations

import asyncio

from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster, unique
from tests.workflows.test_job_workflow import pairs, start
from workers.outcomes import run_result
from workflows.domain.run.views import JobDescription
from workflows.domain.spec import JobSpec, parse_spec


def gang(name: str, replicas: int = 3, **top: object) -> JobSpec:
    group = {"name": "w", "replicas": replicas, "command": ["x"]}
    return parse_spec({"name": name, "gang": True, "groups": [group], **top})


async def test_a_gang_starts_only_once_every_member_is_set_up(time_skipping: WorkflowEnvironment) -> None:
    job = gang(unique("gang"))
    async with fake_cluster(time_skipping.client, Script()) as cluster:
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    barrier = [s.barrier for s in cluster.starts]
    assert barrier == [True, True, True, False, False, False]  # every set-up before any start
    envs = {s.ref.task_id: s.env for s in cluster.starts if not s.barrier}
    assert [envs[t]["RANK"] for t in ("w-0", "w-1", "w-2")] == ["0", "1", "2"]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs.values()} == {("3", "127.0.0.1")}
    history = pairs(described.history)
    assert ("Starting", "Starting together: 0 of 3 ready") in history
    assert ("Starting", "Starting together: 3 of 3 ready") in history
    assert pairs(described.tasks[1].history) == [
        ("Pending", "Waiting for workers to start"),
        ("Pending", "Placed on n0"),
        ("Preparing", "Picked up by n0"),
        ("ReadyToStart", "Waiting at the gang barrier"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
        ("Completed", "Exited with code 0"),
    ]


async def test_a_barrier_that_waits_too_long_requeues_the_gang(own_time_skipping: WorkflowEnvironment) -> None:
    job = gang(unique("late"), replicas=2)
    async with fake_cluster(own_time_skipping.client, Script(late={"w-1.0"})) as cluster:
        handle = await start(own_time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    assert pairs(described.tasks[0].history)[:7] == [
        ("Pending", "Waiting for workers to start"),
        ("Pending", "Placed on n0"),
        ("Preparing", "Picked up by n0"),
        ("ReadyToStart", "Waiting at the gang barrier"),
        ("Stopping", "Gang barrier timed out waiting for all members"),
        ("Cancelled", "Stopped on request"),
        ("Pending", "Gang barrier timed out waiting for all members"),
    ]
    ready, timed_out = described.tasks[0].history[3], described.tasks[0].history[4]
    assert 900 <= (timed_out.at - ready.at).total_seconds() < 901  # the spec's 15 minutes at the barrier
    # w-1's machine never picked it up (its set-up never answered): Pending, so stopped straight to Cancelled.
    assert pairs(described.tasks[1].history)[1:3] == [
        ("Pending", "Placed on n0"),
        ("Cancelled", "Gang barrier timed out waiting for all members"),
    ]
    calls = [(s.ref.task_id, s.ref.attempt, s.barrier) for s in cluster.starts]
    assert calls[0] == ("w-0", 0, True)  # w-1's first set-up never finished
    assert sorted(calls[1:3]) == [("w-0", 1, True), ("w-1", 1, True)]
    assert sorted(calls[3:]) == [("w-0", 1, False), ("w-1", 1, False)]
    assert ("Starting", "Starting together: 1 of 2 ready") in pairs(described.history)


async def test_a_group_that_cannot_be_planned_is_looked_at_again_every_minute(
    own_time_skipping: WorkflowEnvironment,
) -> None:
    from workflows.domain.scheduling.planning import TaskPlan

    job = parse_spec({"name": unique("plan"), "groups": [{"name": "train", "command": ["x"], "total_gpus": 8}]})
    why = "Cannot plan workers: no way to run 8 GPUs on these machines: 4 free on the largest one now"
    plans = [TaskPlan(code="PlanNoWay", reason=why), TaskPlan(workers=2, gpus_per_worker=4)]
    async with fake_cluster(own_time_skipping.client, Script(plans=plans)) as cluster:
        handle = await start(own_time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    history = described.history
    assert pairs(history)[2] == ("Pending", why)
    assert (history[3].at - history[2].at).total_seconds() >= 60
    assert [t.id for t in described.tasks] == ["train-0", "train-1"]
    assert [p.total_gpus for p in cluster.planned] == [8, 8]


# ---- restarts, min_available, complete_with and services in virtual time -----------------------------------------


async def wait_reason(handle, reason: str) -> None:  # type: ignore[no-untyped-def]
    from workflows.domain.run.status import Status

    for _ in range(400):
        if (await handle.query("status", result_type=Status)).reason == reason:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never read {reason!r}")


async def test_a_member_failure_restarts_the_whole_gang(time_skipping: WorkflowEnvironment) -> None:
    job = gang(unique("gang-restart"))
    script = Script(exits={"w-1": [1, 0]}, hold={"w-0.0", "w-2.0"})
    async with fake_cluster(time_skipping.client, script):
        handle = await start(time_skipping, job)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    assert [(t.id, t.attempt, t.restarts) for t in described.tasks] == [("w-0", 1, 0), ("w-1", 1, 1), ("w-2", 1, 0)]
    history = pairs(described.tasks[0].history)
    stopping = history.index(("Stopping", "Gang restart: w-1 failed"))
    assert history[stopping : stopping + 4] == [
        ("Stopping", "Gang restart: w-1 failed"),
        ("Cancelled", "Stopped on request"),
        ("Pending", "Gang restart: w-1 failed"),
        ("Pending", "Placed on n0"),
    ]
    assert ("Pending", "Gang restart: w-1 failed") in pairs(described.history)


async def test_under_restart_task_a_member_restarts_alone_and_a_leader_restarts_all(
    time_skipping: WorkflowEnvironment,
) -> None:
    alone = gang(unique("alone"), on_failure="RestartTask")
    all_ = gang(unique("leader"), on_failure="RestartTask")
    async with fake_cluster(time_skipping.client, Script(exits={"w-1": [1, 0]})):
        handle = await start(time_skipping, alone)
        await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert [(t.id, t.attempt) for t in described.tasks] == [("w-0", 0), ("w-1", 1), ("w-2", 0)]
    assert pairs(described.tasks[1].history)[7] == ("Pending", "Restarted by policy (restart 1/10)")
    async with fake_cluster(time_skipping.client, Script(exits={"w-0": [1, 0]}, hold={"w-1.0", "w-2.0"})):
        handle = await start(time_skipping, all_)
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    assert [(t.id, t.attempt) for t in described.tasks] == [("w-0", 1), ("w-1", 1), ("w-2", 1)]
    assert ("Stopping", "Gang restart: w-0 failed") in pairs(described.tasks[2].history)


async def test_min_available_runs_the_minimum_while_the_rest_wait(time_skipping: WorkflowEnvironment) -> None:
    job = gang(unique("min"), min_available=2)
    async with fake_cluster(time_skipping.client, Script(hold={"w-0", "w-1"}, no_room={"w-2"})):
        handle = await start(time_skipping, job)
        await wait_reason(handle, "2 of 3 workers running")
        await handle.execute_update("cancel")
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert status.state == "Cancelled"
    assert ("Starting", "Starting together: 2 of 2 ready") in pairs(described.history)
    assert pairs(described.tasks[2].history)[1] == ("Pending", "No machine fits: 1 of 1 machines ready")


def two_groups(name: str, **top: object) -> JobSpec:
    groups = [{"name": "eval", "command": ["x"]}, {"name": "server", "command": ["x"], "restart_policy": "Never"}]
    return parse_spec({"name": name, "groups": groups, "complete_with": "eval", **top})


async def test_complete_with_ends_the_run_when_its_group_completes(time_skipping: WorkflowEnvironment) -> None:
    async with fake_cluster(time_skipping.client, Script(hold={"server-0"})):
        handle = await start(time_skipping, two_groups(unique("cw")))
        status = await run_result(handle)
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "Worker group eval completed")
    assert pairs(described.tasks[1].history)[-2:] == [
        ("Stopping", "Run completed"),
        ("Cancelled", "Stopped on request"),
    ]


async def test_complete_with_fails_when_a_serving_group_fails(time_skipping: WorkflowEnvironment) -> None:
    async with fake_cluster(time_skipping.client, Script(hold={"eval-0"}, exits={"server-0": [2]})):
        handle = await start(time_skipping, two_groups(unique("cw-fail")))
        status = await run_result(handle)
    assert (status.state, status.reason) == (
        "Failed",
        "Worker server-0 failed on n0: Exited with code 2; worker group eval cannot finish without it",
    )


async def test_a_service_serves_once_its_check_passes(time_skipping: WorkflowEnvironment) -> None:
    web = {"name": "web", "replicas": 2, "command": ["x"], "readiness": {"command": ["true"]}}
    job = parse_spec({"name": unique("svc"), "lifetime": "Service", "groups": [web]})
    async with fake_cluster(time_skipping.client, Script(hold={"web-0", "web-1"}, healthy={"web-0"})):
        handle = await start(time_skipping, job)
        await wait_reason(handle, "1 of 2 workers serving")
        described = await handle.query("describe", result_type=JobDescription)
        await handle.execute_update("cancel")
        await run_result(handle)
    assert [t.healthy for t in described.tasks] == [True, False]
