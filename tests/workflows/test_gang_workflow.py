"""Gang runs through JobWorkflow in virtual time: the barrier (two start calls per member), its timeout, and
the environment that lets members find each other."""

from __future__ import annotations

from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster, unique
from tests.workflows.test_job_workflow import pairs, start
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, parse_spec
from workflows.domain.views import JobDescription


def gang(name: str, replicas: int = 3, **top: object) -> JobSpec:
    group = {"name": "w", "replicas": replicas, "command": ["x"]}
    return parse_spec({"name": name, "gang": True, "groups": [group], **top})


async def test_a_gang_starts_only_once_every_member_is_set_up(time_skipping: WorkflowEnvironment) -> None:
    job = gang(unique("gang"))
    async with fake_cluster(time_skipping.client, Script()) as cluster:
        handle = await start(time_skipping, job)
        status = await handle.result()
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
        ("Preparing", "Placed on n0"),
        ("ReadyToStart", "Waiting at the gang barrier"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
        ("Completed", "Exited with code 0"),
    ]


async def test_a_barrier_that_waits_too_long_requeues_the_gang(own_time_skipping: WorkflowEnvironment) -> None:
    job = gang(unique("late"), replicas=2)
    settings = Settings(barrier_timeout_seconds=120)
    async with fake_cluster(own_time_skipping.client, Script(late={"w-1.0"}), settings) as cluster:
        handle = await start(own_time_skipping, job)
        status = await handle.result()
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    assert pairs(described.tasks[0].history)[:6] == [
        ("Pending", "Waiting for workers to start"),
        ("Preparing", "Placed on n0"),
        ("ReadyToStart", "Waiting at the gang barrier"),
        ("Stopping", "Gang barrier timed out waiting for all members"),
        ("Cancelled", "Stopped on request"),
        ("Pending", "Gang barrier timed out waiting for all members"),
    ]
    assert pairs(described.tasks[1].history)[1:3] == [
        ("Preparing", "Placed on n0"),
        ("Stopping", "Gang barrier timed out waiting for all members"),
    ]
    calls = [(s.ref.task_id, s.ref.attempt, s.barrier) for s in cluster.starts]
    assert calls[0] == ("w-0", 0, True)  # w-1's first set-up never finished
    assert sorted(calls[1:3]) == [("w-0", 1, True), ("w-1", 1, True)]
    assert sorted(calls[3:]) == [("w-0", 1, False), ("w-1", 1, False)]
    assert ("Starting", "Starting together: 1 of 2 ready") in pairs(described.history)


async def test_a_group_that_cannot_be_planned_is_looked_at_again_every_minute(
    own_time_skipping: WorkflowEnvironment,
) -> None:
    from workflows.domain.planning import WorkerPlan

    job = parse_spec({"name": unique("plan"), "groups": [{"name": "train", "command": ["x"], "total_gpus": 8}]})
    why = "Cannot plan workers: no way to run 8 GPUs on these machines: 4 free on the largest one now"
    plans = [WorkerPlan(code="PlanNoWay", reason=why), WorkerPlan(workers=2, gpus_per_worker=4)]
    async with fake_cluster(own_time_skipping.client, Script(plans=plans)) as cluster:
        handle = await start(own_time_skipping, job)
        status = await handle.result()
        described = await handle.query("describe", result_type=JobDescription)
    assert (status.state, status.reason) == ("Completed", "All workers completed")
    history = described.history
    assert pairs(history)[2] == ("Pending", why)
    assert (history[3].at - history[2].at).total_seconds() >= 60
    assert [t.id for t in described.tasks] == ["train-0", "train-1"]
    assert [p.total_gpus for p in cluster.planned] == [8, 8]
