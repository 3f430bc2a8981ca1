"""What a timer, a stop, a preemption and a restart of all decide, and for which worker only (four bugs the
TaskRecord split found and kept): a time limit, reset or TTL timer applies to the attempt and the state it was armed
for; a stop for good replaces what was to follow the end; a preemption marks only a worker it stops; a restart of
all marks only the workers it stops."""

from __future__ import annotations

from typing import Any

from tests.domain.test_gang import IDS, gang, gone, of, placed, ready, running_gang
from tests.domain.test_job import Story, hello, running_story
from workflows.domain.reasons import Reason
from workflows.domain.run.events import (
    CancelRequested,
    Created,
    HeartbeatLate,
    Place,
    PlacementUpdate,
    Preempt,
    Stop,
    StopConfirmed,
    StopRequested,
    TaskEnded,
    TaskRunning,
    TaskSetupFailed,
    TaskStarted,
    Timer,
    TimerFired,
)
from workflows.domain.run.job import is_settled
from workflows.domain.run.status import Final, RestartAt
from workflows.domain.run.views import describe
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, parse_spec


def run(replicas: int = 1, policy: str = "OnFailure", on_failure: str = "RestartTask", **group: Any) -> JobSpec:
    """`hello` with a failure policy of its own."""
    worker = {"name": "w", "replicas": replicas, "command": ["python"], "restart_policy": policy} | group
    return parse_spec({"name": "hello", "on_failure": on_failure, "groups": [worker]})


def limited() -> JobSpec:
    """One worker with a 60 s time limit."""
    return run(time_limit_seconds=60)


def running(spec: JobSpec, settings: Settings | None = None) -> Story:
    """Created at 1 s; w-i placed on n-i at 2 s, started at 3 s, running at 4 s (its time limit ends at 64 s)."""
    story = Story(spec, settings)
    ids = [f"w-{i}" for i in range(spec.groups[0].replicas)]
    story.step(1, Created())
    story.step(2, *[PlacementUpdate(task_id=t, attempt=0, node=f"n{i}") for i, t in enumerate(ids)])
    story.step(3, *[TaskStarted(task_id=t, attempt=0) for t in ids])
    story.step(4, *[TaskRunning(task_id=t, attempt=0) for t in ids])
    return story


def runs_again(story: Story, second: float, task: str, attempt: int) -> None:
    story.step(second, PlacementUpdate(task_id=task, attempt=attempt, node="n0"))
    story.step(second + 1, TaskStarted(task_id=task, attempt=attempt))
    story.step(second + 2, TaskRunning(task_id=task, attempt=attempt))


TIME_LIMIT = TimerFired(timer=Timer.TIME_LIMIT, task_id="w-0", attempt=0)


# ---- 1. a timer applies to the attempt and the state it was armed for ------------------------------------------


def test_a_time_limit_that_passes_while_the_worker_waits_out_its_back_off_fails_nothing() -> None:
    story = running(limited())
    story.step(63, TaskEnded(task_id="w-0", attempt=0, exit_code=1))  # failed at 59 s of its 60
    assert of(story.step(64, TIME_LIMIT), Stop) == []
    assert story.job.task("w-0").exceeded is None
    assert story.status() == ("Pending", "Exited with code 1")
    story.step(73, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    runs_again(story, 74, "w-0", 1)
    story.step(80, TaskEnded(task_id="w-0", attempt=1, exit_code=0))
    assert story.status() == ("Completed", "All workers completed")


def test_a_time_limit_that_passes_while_a_preempted_worker_stops_leaves_it_to_queue_again() -> None:
    story = running(limited())
    story.step(50, Preempt(task_ids=["w-0"], by="urgent"))
    assert of(story.step(64, TIME_LIMIT), Stop) == []
    assert story.status("w-0") == ("Stopping", "Preempted by higher-priority work (urgent)")
    story.step(65, StopConfirmed(task_id="w-0", attempt=0))
    assert story.status("w-0") == ("Pending", "Preempted by urgent; queued again")
    runs_again(story, 66, "w-0", 1)
    story.step(70, TaskEnded(task_id="w-0", attempt=1, exit_code=0))
    assert story.status() == ("Completed", "All workers completed")


def test_a_time_limit_that_passes_while_a_worker_stops_on_request_leaves_the_run_cancelled() -> None:
    story = running(limited())
    story.step(50, StopRequested(task_id="w-0"))
    story.step(64, TIME_LIMIT)
    story.step(65, StopConfirmed(task_id="w-0", attempt=0))
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")
    assert story.job.task("w-0").exceeded is None


def test_a_time_limit_that_passes_while_the_worker_is_stale_still_stops_it() -> None:
    story = running(limited())
    story.step(30, HeartbeatLate(task_id="w-0", attempt=0))
    assert [s.task_id for s in of(story.step(64, TIME_LIMIT), Stop)] == ["w-0"]
    story.step(65, StopConfirmed(task_id="w-0", attempt=0))
    assert story.status() == ("Failed", "Worker w-0: Exceeded its time limit of 1m")


def test_a_ttl_timer_of_an_earlier_stale_spell_does_not_take_the_worker_down() -> None:
    story = running_story(1, settings=Settings(heartbeat_ttl_seconds=60))
    story.step(10, HeartbeatLate(task_id="w-0", attempt=0))  # its TTL timer ends at 70 s
    story.step(20, TaskRunning(task_id="w-0", attempt=0, heartbeat=True))
    story.step(40, HeartbeatLate(task_id="w-0", attempt=0))  # stale again: this TTL ends at 100 s
    story.step(70, TimerFired(timer=Timer.STALE_TTL, task_id="w-0", attempt=0))
    assert story.status("w-0") == ("Stale", "Heartbeat lease expired")
    story.step(100, TimerFired(timer=Timer.STALE_TTL, task_id="w-0", attempt=0))
    assert story.status("w-0") == ("Down", "No heartbeat for the worker's full TTL after going stale")


# ---- 2. a stop for good replaces what was to follow the end ----------------------------------------------------


def test_a_worker_stopping_for_a_gang_restart_then_cancelled_shows_no_restart() -> None:
    story = running(run(2, on_failure="RestartJob"))
    story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    assert story.status("w-1") == ("Stopping", "Gang restart: w-0 failed")
    story.step(6, CancelRequested())
    story.step(7, StopConfirmed(task_id="w-1", attempt=0))
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")
    assert [(t.id, t.restart_at) for t in describe(story.job).tasks] == [("w-0", None), ("w-1", None)]
    assert is_settled(story.job)


def test_a_worker_stopping_for_a_gang_restart_then_stopped_by_a_person_stays_stopped() -> None:
    story = running(run(2, on_failure="RestartJob"))
    story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(6, StopRequested(task_id="w-1"))
    story.step(7, StopConfirmed(task_id="w-1", attempt=0))
    assert story.job.task("w-1").after == Final()
    assert describe(story.job).tasks[1].restart_at is None
    (place,) = of(story.step(15, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0)), Place)
    assert [r.task_id for r in place.requests] == ["w-0"]  # the worker stopped for good is not queued again
    assert story.status("w-1") == ("Cancelled", "Stopped on request")


def test_a_gang_member_stopping_for_a_gang_restart_then_cancelled_shows_no_restart() -> None:
    story = running_gang()
    story.step(10, TaskEnded(task_id="w-2", attempt=0, exit_code=1))
    story.step(11, CancelRequested())
    gone(story, 12, ["w-0", "w-1", "w-3"])
    assert story.status() == ("Cancelled", "All workers ended; some were cancelled")
    assert [t.restart_at for t in describe(story.job).tasks] == [None] * 4


# ---- 3. a preemption marks only a worker it stops --------------------------------------------------------------


def test_a_preemption_of_a_worker_in_its_back_off_leaves_it_unmarked() -> None:
    story = running_story(1)
    story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    assert of(story.step(6, Preempt(task_ids=["w-0"], by="urgent")), Stop) == []
    assert story.job.task("w-0").preempted_by is None
    story.step(15, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    assert story.status() == ("Pending", "Restarted by policy (restart 1/10)")


def test_a_preemption_of_a_waiting_worker_leaves_it_unmarked() -> None:
    story = Story(hello(2))
    story.step(1, Created())
    story.step(2, PlacementUpdate(task_id="w-0", attempt=0, node="n0"))
    assert of(story.step(3, Preempt(task_ids=["w-1"], by="urgent")), Stop) == []
    assert story.job.task("w-1").preempted_by is None
    assert story.status() == ("Pending", "Waiting for workers to start")


def test_a_second_preemption_of_a_worker_stopping_keeps_the_first_one() -> None:
    story = running_story(1)
    story.step(5, Preempt(task_ids=["w-0"], by="first"))
    assert of(story.step(6, Preempt(task_ids=["w-0"], by="second")), Stop) == []
    story.step(7, StopConfirmed(task_id="w-0", attempt=0))
    assert story.status("w-0") == ("Pending", "Preempted by first; queued again")
    assert story.status() == ("Pending", "Preempted by higher-priority work (first); waiting to run again")


def test_a_preemption_of_a_worker_stopping_on_request_leaves_it_unmarked() -> None:
    story = running_story(2)
    story.step(5, StopRequested(task_id="w-0"))
    story.step(6, Preempt(task_ids=["w-0"], by="urgent"))
    assert story.job.task("w-0").preempted_by is None


# ---- 4. a restart of all marks only the workers it stops ------------------------------------------------------


def restart_job_with_one_waiting(policy: str = "OnFailure") -> Story:
    """RestartJob, two workers: w-0 runs (since 4 s), w-1 still waits for room."""
    story = Story(run(2, policy, on_failure="RestartJob"))
    story.step(1, Created())
    story.step(2, PlacementUpdate(task_id="w-0", attempt=0, node="n0"))
    story.step(3, TaskStarted(task_id="w-0", attempt=0))
    story.step(4, TaskRunning(task_id="w-0", attempt=0))
    return story


def test_a_restart_of_all_leaves_a_waiting_worker_waiting_unmarked() -> None:
    story = restart_job_with_one_waiting()
    commands = story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    assert of(commands, Stop) == []
    assert story.job.task("w-1").after is None
    assert story.status("w-1") == ("Pending", "Waiting for workers to start")


def test_under_always_a_worker_waiting_at_a_restart_of_all_restarts_later_by_its_own_policy() -> None:
    story = restart_job_with_one_waiting("Always")
    story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(6, PlacementUpdate(task_id="w-1", attempt=0, node="n1"))
    story.step(7, TaskStarted(task_id="w-1", attempt=0))
    story.step(8, TaskRunning(task_id="w-1", attempt=0))
    story.step(9, TaskEnded(task_id="w-1", attempt=0, exit_code=0))
    assert isinstance(story.job.task("w-1").after, RestartAt)
    story.step(19, TimerFired(timer=Timer.RESTART, task_id="w-1", attempt=0))
    assert story.status("w-1") == ("Pending", "Restarted by policy (restart 1/10)")


def test_a_worker_waiting_at_a_restart_of_all_and_placed_later_does_not_show_the_gang_restart() -> None:
    story = restart_job_with_one_waiting()
    story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    story.step(15, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    fits = Reason("NoMachineFits", "No machine fits: 0 of 1 machines ready")
    story.step(16, PlacementUpdate(task_id="w-0", attempt=1, reason=fits))
    story.step(17, PlacementUpdate(task_id="w-1", attempt=0, node="n1"))
    story.step(18, TaskStarted(task_id="w-1", attempt=0))  # Starting, not yet running
    assert story.status() == ("Pending", "No machine fits: 0 of 1 machines ready")


def test_a_restart_of_all_leaves_a_worker_in_its_own_back_off_to_its_policy() -> None:
    story = restart_job_with_one_waiting("Always")
    story.step(6, PlacementUpdate(task_id="w-1", attempt=0, node="n1"))
    story.step(7, TaskStarted(task_id="w-1", attempt=0))
    story.step(8, TaskRunning(task_id="w-1", attempt=0))
    story.step(9, TaskEnded(task_id="w-1", attempt=0, exit_code=0))  # its back-off ends at 19 s
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))  # w-0's ends at 20 s
    assert story.job.task("w-1").after == RestartAt(at=story.job.task("w-1").restart_at)
    story.step(19, TimerFired(timer=Timer.RESTART, task_id="w-1", attempt=0))
    assert story.status("w-1") == ("Pending", "Restarted by policy (restart 1/10)")


def test_a_restart_of_all_leaves_a_worker_stopping_already_to_its_stop() -> None:
    story = running(run(3, on_failure="RestartJob"))
    story.step(5, Preempt(task_ids=["w-2"], by="urgent"))
    commands = story.step(6, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    assert [s.task_id for s in of(commands, Stop)] == ["w-1"]
    assert story.job.task("w-2").after is None
    story.step(7, StopConfirmed(task_id="w-2", attempt=0))
    assert story.status("w-2") == ("Pending", "Preempted by urgent; queued again")


def test_a_restart_of_all_by_another_workers_back_off_requeues_no_one_early() -> None:
    """A worker restarted by its own policy does not take along those stopped for another's gang restart: they wait
    for the failed worker's back-off."""
    story = running(run(3, "Always", on_failure="RestartJob"))
    story.step(5, TaskEnded(task_id="w-2", attempt=0, exit_code=0))  # Always: back again at 15 s
    story.step(8, TaskEnded(task_id="w-0", attempt=0, exit_code=1))  # stops w-1; back again at 18 s
    story.step(9, StopConfirmed(task_id="w-1", attempt=0))
    (place,) = of(story.step(15, TimerFired(timer=Timer.RESTART, task_id="w-2", attempt=0)), Place)
    assert [r.task_id for r in place.requests] == ["w-2"]
    assert story.status("w-1") == ("Cancelled", "Stopped on request")
    (place,) = of(story.step(18, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0)), Place)
    assert [r.task_id for r in place.requests] == ["w-0", "w-1"]


def test_a_gang_member_waiting_at_a_leader_restart_later_fails_and_restarts_by_its_own_timer() -> None:
    """RestartTask with min_available: w-3 waits while the leader's failure restarts the others; once the gang
    runs again, w-3 fails on its own and its restart timer restarts it alone."""
    story = Story(gang(on_failure="RestartTask", min_available=3))
    story.step(1, Created())
    placed(story, 2, IDS[:3])
    ready(story, 3, IDS[:3])
    story.step(4, *[TaskStarted(task_id=t, attempt=0) for t in IDS[:3]])
    story.step(5, *[TaskRunning(task_id=t, attempt=0) for t in IDS[:3]])
    story.step(10, TaskEnded(task_id="w-0", attempt=0, exit_code=1))  # the leader: the gang restarts
    assert story.job.task("w-3").after is None
    gone(story, 11, ["w-1", "w-2"])
    story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    placed(story, 21, IDS[:3], attempt=1)
    ready(story, 22, IDS[:3], attempt=1)
    story.step(23, *[TaskStarted(task_id=t, attempt=1) for t in IDS[:3]])
    story.step(24, *[TaskRunning(task_id=t, attempt=1) for t in IDS[:3]])
    assert story.status() == ("Running", "3 of 4 workers running")
    placed(story, 25, ["w-3"])
    failed = Reason("ErrImagePull", "ErrImagePull: not found")
    story.step(26, TaskSetupFailed(task_id="w-3", attempt=0, reason=failed))
    (place,) = of(story.step(36, TimerFired(timer=Timer.RESTART, task_id="w-3", attempt=0)), Place)
    assert [(r.task_id, r.attempt) for r in place.requests] == [("w-3", 1)]
    assert story.status("w-3") == ("Pending", "Restarted by policy (restart 1/10)")


def test_a_gang_member_in_its_back_off_at_a_leader_restart_comes_back_with_the_gang_restarted_by_its_policy() -> None:
    """Not stopped by the restart, it is not queued with its reason: its own policy restarts it (counted), but with
    the gang, which comes back whole once every back-off is over."""
    story = running_gang(gang(on_failure="RestartTask"))
    story.step(10, TaskEnded(task_id="w-3", attempt=0, exit_code=1))  # back again at 20 s
    story.step(12, TaskEnded(task_id="w-0", attempt=0, exit_code=1))  # the leader: back again at 22 s
    gone(story, 13, ["w-1", "w-2"])
    assert of(story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-3", attempt=0)), Place) == []
    (place,) = of(story.step(22, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0)), Place)
    assert [(r.task_id, r.attempt) for r in place.requests] == [(t, 1) for t in IDS]
    assert story.history("w-3")[-2:] == [
        ("Failed", "Exited with code 1"),
        ("Pending", "Restarted by policy (restart 1/10)"),
    ]
    assert story.status("w-0") == ("Pending", "Gang restart: w-0 failed")
    assert story.status("w-1") == ("Pending", "Gang restart: w-0 failed")
    assert [t.restarts for t in story.job.tasks] == [1, 0, 0, 1]
