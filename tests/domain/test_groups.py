"""Runs of several groups as pure decisions: complete_with, services with readiness, depends_on, arrays, and the
"Quota reached" entry."""

from __future__ import annotations

from typing import Any

from tests.domain.test_job import Story
from workflows.domain.run.events import (
    Command,
    Created,
    Place,
    PlacementUpdate,
    Stop,
    TaskEnded,
    TaskHealth,
    TaskRunning,
    TaskStarted,
)
from workflows.domain.spec import JobSpec, parse_spec


def spec(*groups: dict[str, Any], **top: Any) -> JobSpec:
    return parse_spec({"name": "hello", "groups": [{"command": ["x"]} | g for g in groups]} | top)


def of(commands: list[Command], kind: type) -> list[Any]:
    return [c for c in commands if isinstance(c, kind)]


def run(story: Story, second: float, *ids: str, attempt: int = 0) -> None:
    """Place each worker on n-<id>, start it and see it run."""
    story.step(second, *[PlacementUpdate(task_id=t, attempt=attempt, node=f"n-{t}") for t in ids])
    story.step(second, *[TaskStarted(task_id=t, attempt=attempt) for t in ids])
    story.step(second, *[TaskRunning(task_id=t, attempt=attempt) for t in ids])


# ---- complete_with ----------------------------------------------------------------------------------------------


def test_a_run_completes_with_its_group_and_stops_the_rest() -> None:
    story = Story(spec({"name": "eval"}, {"name": "server", "replicas": 2}, complete_with="eval"))
    story.step(1, Created())
    run(story, 2, "eval-0", "server-0", "server-1")
    commands = story.step(3, TaskEnded(task_id="eval-0", attempt=0, exit_code=0))
    assert story.status() == ("Completed", "Worker group eval completed")
    assert [s.task_id for s in of(commands, Stop)] == ["server-0", "server-1"]
    assert story.status("server-0") == ("Stopping", "Run completed")
    story.step(4, *[TaskEnded(task_id=t, attempt=0, exit_code=143) for t in ("server-0", "server-1")])
    assert story.status() == ("Completed", "Worker group eval completed")


def test_a_serving_group_that_fails_for_good_fails_the_run() -> None:
    server = {"name": "server", "restart_policy": "Never"}
    story = Story(spec({"name": "eval"}, server, complete_with="eval"))
    story.step(1, Created())
    run(story, 2, "eval-0", "server-0")
    story.step(3, TaskEnded(task_id="server-0", attempt=0, exit_code=2))
    assert story.status() == (
        "Failed",
        "Worker server-0 failed on n-server-0: Exited with code 2; worker group eval cannot finish without it",
    )
    assert story.status("eval-0") == ("Stopping", "A worker failed, and the run fails on a failure")


# ---- services ---------------------------------------------------------------------------------------------------


def test_a_service_counts_the_workers_that_serve() -> None:
    readiness = {"http_get": {"port": 8080}}
    story = Story(spec({"name": "api", "replicas": 2, "readiness": readiness}, lifetime="Service"))
    story.step(1, Created())
    run(story, 2, "api-0", "api-1")
    assert story.status() == ("Running", "0 of 2 workers serving")
    story.step(3, TaskHealth(task_id="api-0", attempt=0, healthy=True))
    assert story.status() == ("Running", "1 of 2 workers serving")
    story.step(4, TaskHealth(task_id="api-1", attempt=0, healthy=True))
    story.step(5, TaskHealth(task_id="api-0", attempt=0, healthy=False, detail="HTTP 503"))
    assert [r for _, r in story.run_history()[-3:]] == [
        "1 of 2 workers serving",
        "2 of 2 workers serving",
        "1 of 2 workers serving",
    ]


def test_a_service_without_readiness_serves_while_it_runs() -> None:
    story = Story(spec({"name": "api"}, lifetime="Service"))
    story.step(1, Created())
    run(story, 2, "api-0")
    assert story.status() == ("Running", "1 of 1 workers serving")


# ---- depends_on -------------------------------------------------------------------------------------------------


def test_a_group_waits_for_the_group_it_depends_on_to_be_healthy() -> None:
    db = {"name": "db", "readiness": {"command": ["pg_isready"]}}
    app = {"name": "app", "replicas": 2, "depends_on": [{"group": "db", "condition": "healthy"}]}
    story = Story(spec(db, app))
    (place,) = of(story.step(1, Created()), Place)
    assert [r.task_id for r in place.requests] == ["db-0"]
    assert story.status("app-0") == ("Pending", "Waits for worker group db to be healthy")
    assert story.status() == ("Pending", "Waiting for workers to start")
    run(story, 3, "db-0")
    assert story.status("app-1") == ("Pending", "Waits for worker group db to be healthy")
    (place,) = of(story.step(4, TaskHealth(task_id="db-0", attempt=0, healthy=True)), Place)
    assert [r.task_id for r in place.requests] == ["app-0", "app-1"]
    assert story.history("app-0") == [
        ("Pending", "Waiting for workers to start"),
        ("Pending", "Waits for worker group db to be healthy"),
        ("Pending", "Waiting for workers to start"),
    ]


def test_a_group_waits_for_running_and_a_completed_group_counts() -> None:
    setup = {"name": "setup"}
    app = {"name": "app", "depends_on": [{"group": "setup"}]}
    story = Story(spec(setup, app))
    story.step(1, Created())
    assert story.status("app-0") == ("Pending", "Waits for worker group setup to be running")
    story.step(2, PlacementUpdate(task_id="setup-0", attempt=0, node="n0"))
    story.step(3, TaskStarted(task_id="setup-0", attempt=0))
    commands = story.step(3, TaskEnded(task_id="setup-0", attempt=0, exit_code=0))  # ended before a report
    assert [r.task_id for c in of(commands, Place) for r in c.requests] == ["app-0"]


def test_a_held_worker_is_not_asked_of_the_scheduler_and_cancel_ends_it() -> None:
    from workflows.domain.run.events import CancelRequested

    story = Story(spec({"name": "db"}, {"name": "app", "depends_on": [{"group": "db"}]}))
    story.step(1, Created())
    assert story.job.task("app-0").gated
    story.step(2, CancelRequested())
    assert story.status("app-0") == ("Cancelled", "Run cancelled")


# ---- arrays and quota ---------------------------------------------------------------------------------------------


def test_an_array_asks_with_its_max_parallel() -> None:
    story = Story(spec({"name": "shard", "replicas": 5, "array": {"max_parallel": 2}}))
    (place,) = of(story.step(1, Created()), Place)
    assert {r.max_parallel for r in place.requests} == {2}
    wait = PlacementUpdate(
        task_id="shard-3", attempt=0, code="ArrayMaxParallel", reason="Array runs at most 2 workers at once"
    )
    story.step(2, wait)
    assert story.status("shard-3") == ("Pending", "Array runs at most 2 workers at once")


def test_quota_reached_is_written_once_to_the_run_history() -> None:
    story = Story(spec({"name": "w", "replicas": 2}))
    story.step(1, Created())
    why = "Quota reached: gpus 6 in use + 4 asked > 8"
    waits = "Waits for namespace quota: gpus 6 in use + 4 asked > 8"
    for second, task in ((2, "w-0"), (3, "w-1")):
        update = PlacementUpdate(task_id=task, attempt=0, code="WaitsForQuota", reason=waits, quota_reached=why)
        story.step(second, update)
    assert story.run_history()[-2:] == [("Pending", why), ("Pending", waits)]
    assert [e.code for e in story.job.history].count("QuotaReached") == 1
    assert story.status() == ("Pending", waits)


# ---- planning a group of total_gpus ---------------------------------------------------------------------------------


def test_a_group_of_total_gpus_is_planned_then_created() -> None:
    from workflows.domain.run.events import ArmTimer, GroupPlanned, PlanGroup, Timer, TimerFired
    from workflows.domain.run.tasks import group_of

    story = Story(spec({"name": "train", "total_gpus": 16}, {"name": "eval"}))
    (plan,) = story.step(1, Created())
    assert isinstance(plan, PlanGroup)
    assert (plan.group, plan.total_gpus, plan.machines, plan.request.gpus) == ("train", 16, None, 0)
    assert story.job.tasks == []
    why = "Cannot plan workers: no way to run 16 GPUs on these machines: 4 free on the largest one now"
    commands = story.step(2, GroupPlanned(group="train", code="PlanNoWay", reason=why))
    assert story.status() == ("Pending", why)
    assert story.job.status.code == "CannotPlanWorkers"
    assert commands == [ArmTimer(timer=Timer.REPLAN, task_id="train", attempt=0, at=commands[0].at)]
    assert (commands[0].at - story.job.status.created_at).total_seconds() == 62
    (again,) = story.step(62, TimerFired(timer=Timer.REPLAN, task_id="train", attempt=0))
    assert again == plan

    (place,) = of(story.step(63, GroupPlanned(group="train", workers=2, gpus_per_worker=8)), Place)
    assert [(r.task_id, r.gpus) for r in place.requests] == [("train-0", 8), ("train-1", 8), ("eval-0", 0)]
    assert group_of(story.job, story.job.task("train-1")).replicas == 2
    assert [r for _, r in story.run_history()] == [
        "Run created",
        "Waiting for workers to be created",
        why,
        "Waiting for workers to start",
    ]


def test_a_run_cancelled_while_it_is_planned_ends_cancelled() -> None:
    from workflows.domain.run.events import CancelRequested, Timer, TimerFired
    from workflows.domain.run.job import is_settled

    story = Story(spec({"name": "train", "total_gpus": 16, "machines": 3}))
    story.step(1, Created())
    story.step(2, CancelRequested())
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")
    assert is_settled(story.job)
    assert story.step(62, TimerFired(timer=Timer.REPLAN, task_id="train", attempt=0)) == []
