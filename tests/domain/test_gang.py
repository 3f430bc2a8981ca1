"""Gang runs as pure decisions: the barrier, restarts, failures, preemption and min_available, with whole reasons."""

from __future__ import annotations

from typing import Any

from tests.domain.test_job import Story, at
from workflows.domain.reasons import Reason
from workflows.domain.run.events import (
    ArmTimer,
    Command,
    Created,
    Place,
    PlacementUpdate,
    Preempt,
    Start,
    Stop,
    TaskEnded,
    TaskReady,
    TaskRunning,
    TaskStarted,
    Timer,
    TimerFired,
)
from workflows.domain.run.tasks import master_port
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, parse_spec

IDS = ["w-0", "w-1", "w-2", "w-3"]


def gang(replicas: int = 4, **top: Any) -> JobSpec:
    group = {"name": "w", "replicas": replicas, "command": ["train"]} | top.pop("group", {})
    return parse_spec({"name": "hello", "gang": True, "groups": [group]} | top)


def of(commands: list[Command], kind: type) -> list[Any]:
    return [c for c in commands if isinstance(c, kind)]


def placed(story: Story, second: float, ids: list[str] = IDS, attempt: int = 0) -> list[Command]:
    """Each member on its own machine n<i> (address 10.0.0.<i>)."""
    updates = []
    for task in ids:
        i = int(task.split("-")[1])
        updates.append(PlacementUpdate(task_id=task, attempt=attempt, node=f"n{i}", address=f"10.0.0.{i}"))
    return story.step(second, *updates)


def ready(story: Story, second: float, ids: list[str] = IDS, attempt: int = 0) -> list[Command]:
    return story.step(second, *[TaskReady(task_id=t, attempt=attempt) for t in ids])


def running_gang(spec: JobSpec | None = None, settings: Settings | None = None) -> Story:
    """Created at 1 s, placed at 2 s, ready at 3 s, started at 4 s, running at 5 s."""
    story = Story(spec or gang(), settings)
    story.step(1, Created())
    placed(story, 2)
    ready(story, 3)
    story.step(4, *[TaskStarted(task_id=t, attempt=0) for t in IDS])
    story.step(5, *[TaskRunning(task_id=t, attempt=0) for t in IDS])
    return story


def gone(story: Story, second: float, ids: list[str], attempt: int = 0) -> list[Command]:
    return story.step(second, *[TaskEnded(task_id=t, attempt=attempt, exit_code=143) for t in ids])


# ---- the barrier ------------------------------------------------------------------------------------------------


def test_members_wait_at_the_barrier_and_start_together() -> None:
    story = Story(gang())
    (place,) = story.step(1, Created())
    assert isinstance(place, Place)
    assert [(r.task_id, r.gang) for r in place.requests] == [(t, True) for t in IDS]

    starts = of(placed(story, 2), Start)
    assert [(s.task_id, s.barrier) for s in starts] == [(t, True) for t in IDS]
    assert story.status() == ("Starting", "Starting together: 0 of 4 ready")

    commands = ready(story, 3, IDS[:3])
    assert of(commands, Start) == []
    assert of(commands, ArmTimer) == [ArmTimer(timer=Timer.BARRIER, task_id="", attempt=0, at=at(3 + 900))]
    assert story.status("w-0") == ("ReadyToStart", "Waiting at the gang barrier")
    assert story.status() == ("Starting", "Starting together: 3 of 4 ready")

    starts = of(ready(story, 4, ["w-3"]), Start)
    assert [(s.task_id, s.barrier) for s in starts] == [(t, False) for t in IDS]
    assert all(s.host_network for s in starts)  # so that the others reach the leader at MASTER_ADDR:MASTER_PORT
    env = starts[2].env
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("2", "4", "10.0.0.0")
    assert env["MASTER_PORT"] == str(master_port("job/default/hello"))
    assert story.status() == ("Starting", "Starting together: 4 of 4 ready")

    story.step(5, *[TaskStarted(task_id=t, attempt=0) for t in IDS])
    assert story.status("w-1") == ("Starting", "Container started")
    story.step(6, *[TaskRunning(task_id=t, attempt=0) for t in IDS[:3]])
    assert story.status() == ("Starting", "Starting together: 4 of 4 ready")
    story.step(7, TaskRunning(task_id="w-3", attempt=0))
    assert story.run_history() == [
        ("Pending", "Run created"),
        ("Pending", "Waiting for workers to be created"),
        ("Pending", "Waiting for workers to start"),
        ("Starting", "Starting together: 0 of 4 ready"),
        ("Starting", "Starting together: 3 of 4 ready"),
        ("Starting", "Starting together: 4 of 4 ready"),
        ("Running", "4 of 4 workers running"),
    ]
    assert story.history("w-0") == [
        ("Pending", "Waiting for workers to start"),
        ("Preparing", "Placed on n0"),
        ("ReadyToStart", "Waiting at the gang barrier"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
    ]


def test_the_barrier_timeout_requeues_the_gang_once_every_member_is_gone() -> None:
    story = Story(gang())
    story.step(1, Created())
    placed(story, 2)
    ready(story, 3, IDS[:3])  # w-3 is still preparing
    commands = story.step(903, TimerFired(timer=Timer.BARRIER, task_id="", attempt=0))
    assert [s.task_id for s in of(commands, Stop)] == IDS
    assert story.status("w-3") == ("Stopping", "Gang barrier timed out waiting for all members")
    assert story.status() == ("Starting", "Starting together: 3 of 4 ready")

    assert of(gone(story, 904, IDS[:3]), Place) == []  # w-3 still on its machine
    (place,) = of(gone(story, 905, ["w-3"]), Place)
    assert [(r.task_id, r.attempt) for r in place.requests] == [(t, 1) for t in IDS]
    assert story.status() == ("Pending", "Gang barrier timed out waiting for all members")
    assert story.history("w-1")[-3:] == [
        ("Stopping", "Gang barrier timed out waiting for all members"),
        ("Cancelled", "Stopped on request"),
        ("Pending", "Gang barrier timed out waiting for all members"),
    ]
    assert story.job.task("w-1").restarts == 0


def test_a_barrier_timer_of_an_opened_barrier_does_nothing() -> None:
    story = running_gang()
    assert story.step(903, TimerFired(timer=Timer.BARRIER, task_id="", attempt=0)) == []
    assert story.status() == ("Running", "4 of 4 workers running")


# ---- failures ---------------------------------------------------------------------------------------------------


def test_a_gang_restarts_whole_by_default() -> None:
    story = running_gang()
    commands = story.step(10, TaskEnded(task_id="w-2", attempt=0, exit_code=1))
    assert [s.task_id for s in of(commands, Stop)] == ["w-0", "w-1", "w-3"]
    assert story.status("w-0") == ("Stopping", "Gang restart: w-2 failed")
    assert of(gone(story, 11, ["w-0", "w-1", "w-3"]), Place) == []  # w-2's back-off (10 s) is not over
    assert story.status() == ("Pending", "Gang restart: w-2 failed")

    (place,) = of(story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-2", attempt=0)), Place)
    assert [(r.task_id, r.attempt) for r in place.requests] == [(t, 1) for t in IDS]
    assert [(t.id, t.restarts) for t in story.job.tasks] == [("w-0", 0), ("w-1", 0), ("w-2", 1), ("w-3", 0)]
    assert story.history("w-2")[-2:] == [("Failed", "Exited with code 1"), ("Pending", "Gang restart: w-2 failed")]
    assert story.history("w-0")[-3:] == [
        ("Stopping", "Gang restart: w-2 failed"),
        ("Cancelled", "Stopped on request"),
        ("Pending", "Gang restart: w-2 failed"),
    ]
    assert story.run_history()[-2:] == [("Running", "4 of 4 workers running"), ("Pending", "Gang restart: w-2 failed")]
    placed(story, 21, attempt=1)
    assert story.status() == ("Starting", "Starting together: 0 of 4 ready")


def test_under_restart_task_only_a_failed_member_restarts() -> None:
    story = running_gang(gang(on_failure="RestartTask"))
    assert of(story.step(10, TaskEnded(task_id="w-2", attempt=0, exit_code=1)), Stop) == []
    assert story.status() == ("Pending", "Exited with code 1")
    (place,) = of(story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-2", attempt=0)), Place)
    assert [r.task_id for r in place.requests] == ["w-2"]
    assert story.status("w-2") == ("Pending", "Restarted by policy (restart 1/10)")
    assert of(placed(story, 21, ["w-2"], attempt=1), Start)[0].barrier
    assert story.status() == ("Starting", "Starting together: 3 of 4 ready")
    (start,) = of(ready(story, 22, ["w-2"], attempt=1), Start)  # the others are past the barrier: it starts
    assert (start.task_id, start.barrier) == ("w-2", False)
    story.step(23, TaskStarted(task_id="w-2", attempt=1))
    story.step(24, TaskRunning(task_id="w-2", attempt=1))
    assert story.run_history()[-6:] == [
        ("Running", "4 of 4 workers running"),
        ("Pending", "Exited with code 1"),  # a gang runs only while every member runs
        ("Pending", "Restarted by policy (restart 1/10)"),
        ("Starting", "Starting together: 3 of 4 ready"),
        ("Starting", "Starting together: 4 of 4 ready"),
        ("Running", "4 of 4 workers running"),
    ]


def test_under_restart_task_a_leader_failure_restarts_all() -> None:
    story = running_gang(gang(on_failure="RestartTask", leader="w-1"))
    commands = story.step(10, TaskEnded(task_id="w-1", attempt=0, exit_code=1))
    assert [s.task_id for s in of(commands, Stop)] == ["w-0", "w-2", "w-3"]
    assert story.status("w-3") == ("Stopping", "Gang restart: w-1 failed")


def test_the_named_leader_is_rank_0_and_the_master() -> None:
    story = Story(gang(on_failure="RestartTask", leader="w-2"))
    story.step(1, Created())
    placed(story, 2)
    starts = {s.task_id: s.env for s in of(ready(story, 3), Start)}
    assert [starts[t]["RANK"] for t in IDS] == ["1", "2", "0", "3"]
    assert {env["MASTER_ADDR"] for env in starts.values()} == {"10.0.0.2"}


def test_on_the_node_network_the_master_is_the_address_the_leaders_machine_held_for_it_there() -> None:
    story = Story(gang(leader="w-1", group={"network": {"mesh": True}}))
    story.step(1, Created())
    placed(story, 2)
    members = [TaskReady(task_id=t, attempt=0, node_address=f"10.200.{i}.254") for i, t in enumerate(IDS)]
    starts = of(story.step(3, *members), Start)
    assert {s.env["MASTER_ADDR"] for s in starts} == {"10.200.1.254"}  # w-1's, not its machine's 10.0.0.1
    assert [(s.task_id, s.barrier) for s in starts] == [(t, False) for t in IDS]
    assert story.job.task("w-1").attempt.node_address == "10.200.1.254"


def test_a_member_that_fails_for_good_fails_the_run() -> None:
    story = running_gang(gang(group={"restart_policy": "Never"}))
    commands = story.step(10, TaskEnded(task_id="w-1", attempt=0, exit_code=3))
    assert story.status() == ("Failed", "Worker w-1 failed on n1: Exited with code 3; the gang does not run without it")
    assert [s.task_id for s in of(commands, Stop)] == ["w-0", "w-2", "w-3"]
    assert story.status("w-0") == ("Stopping", "A worker failed, and the run fails on a failure")


def test_a_member_out_of_budget_stops_the_others_with_its_reason() -> None:
    story = running_gang(gang(), Settings(restart_budget=0))
    story.step(10, TaskEnded(task_id="w-1", attempt=0, exit_code=3))
    assert story.status() == (
        "Failed",
        "Worker w-1 failed on n1: Retry budget exhausted after 0/0 restarts; the gang does not run without it",
    )
    assert story.status("w-3") == ("Stopping", "A gang member exhausted its restart budget")


def test_a_member_past_its_time_limit_fails_the_gang() -> None:
    story = running_gang(gang(group={"time_limit_seconds": 60}))
    story.step(65, TimerFired(timer=Timer.TIME_LIMIT, task_id="w-0", attempt=0))
    story.step(66, TaskEnded(task_id="w-0", attempt=0, exit_code=143))
    assert story.status() == ("Failed", "Worker w-0: Exceeded its time limit of 1m; the gang does not run without it")
    assert story.status("w-1") == ("Stopping", "A gang member exceeded its time limit")


# ---- preemption -------------------------------------------------------------------------------------------------


def test_a_preempted_gang_leaves_whole_and_queues_again_once_every_member_is_gone() -> None:
    story = running_gang()
    commands = story.step(10, Preempt(task_ids=["w-3"], by="urgent"))
    assert [s.task_id for s in of(commands, Stop)] == IDS
    assert story.status("w-0") == ("Stopping", "Preempted by higher-priority work (urgent)")
    assert of(gone(story, 11, IDS[:3]), Place) == []
    (place,) = of(gone(story, 12, ["w-3"]), Place)
    assert [(r.task_id, r.attempt) for r in place.requests] == [(t, 1) for t in IDS]
    assert story.status("w-2") == ("Pending", "Preempted by urgent; queued again")
    assert story.status() == ("Pending", "Preempted by higher-priority work (urgent); waiting to run again")
    assert [t.restarts for t in story.job.tasks] == [0, 0, 0, 0]


# ---- min_available ----------------------------------------------------------------------------------------------


def test_with_min_available_the_minimum_starts_together() -> None:
    story = Story(gang(min_available=2))
    story.step(1, Created())
    placed(story, 2, ["w-0", "w-1"])
    assert story.status() == ("Starting", "Starting together: 0 of 2 ready")
    assert of(ready(story, 3, ["w-0"]), Start) == []
    starts = of(ready(story, 4, ["w-1"]), Start)
    assert [(s.task_id, s.barrier) for s in starts] == [("w-0", False), ("w-1", False)]
    story.step(5, *[TaskStarted(task_id=t, attempt=0) for t in ["w-0", "w-1"]])
    story.step(6, *[TaskRunning(task_id=t, attempt=0) for t in ["w-0", "w-1"]])
    assert story.status() == ("Running", "2 of 4 workers running")


def test_a_start_that_fails_after_the_barrier_opened_restarts_the_gang() -> None:
    from workflows.domain.run.events import TaskSetupFailed

    story = Story(gang(replicas=2))
    story.step(1, Created())
    placed(story, 2, ["w-0", "w-1"])
    ready(story, 3, ["w-0", "w-1"])
    failed = TaskSetupFailed(
        task_id="w-1", attempt=0, reason=Reason("ContainerStartFailed", "Container start failed: no such file")
    )
    commands = story.step(4, TaskStarted(task_id="w-0", attempt=0), failed)
    assert story.history("w-1")[-2:] == [
        ("ReadyToStart", "Waiting at the gang barrier"),
        ("Failed", "Container start failed: no such file"),
    ]
    assert [s.task_id for s in of(commands, Stop)] == ["w-0"]
    assert story.status("w-0") == ("Stopping", "Gang restart: w-1 failed")


def test_a_gang_cancelled_at_the_barrier_ends_once_its_machines_confirm_the_stops() -> None:
    from workflows.domain.run.events import CancelRequested, StopConfirmed
    from workflows.domain.run.job import is_settled

    story = Story(gang(replicas=2))
    story.step(1, Created())
    placed(story, 2, ["w-0", "w-1"])
    ready(story, 3, ["w-0"])
    commands = story.step(4, CancelRequested())
    assert [s.task_id for s in of(commands, Stop)] == ["w-0", "w-1"]
    assert story.status("w-0") == ("Stopping", "Run cancelled")
    story.step(5, StopConfirmed(task_id="w-0", attempt=0))
    assert story.status("w-0") == ("Cancelled", "Stopped on request")
    assert not is_settled(story.job)
    story.step(6, StopConfirmed(task_id="w-1", attempt=0))
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")
    assert is_settled(story.job)
