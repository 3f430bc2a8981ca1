"""`effects(job, now)`: what a run's record needs in flight, state by state (what a run that continues as new
carries out first), and, over random runs, that `decide` issues what each decision newly needs."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.domain.test_job_properties import SHRUNK, choices, played
from workflows.domain.reasons import Reason
from workflows.domain.run.effects import (
    Effect,
    covered_in_a_live_run,
    difference,
    effects,
    identities,
    identity,
    one_offs,
)
from workflows.domain.run.events import (
    ArmTimer,
    CancelRequested,
    Command,
    Created,
    Event,
    HeartbeatLate,
    Place,
    PlacementUpdate,
    PlanGroup,
    Release,
    Start,
    Stop,
    StopRequested,
    Supervise,
    TaskEnded,
    TaskProgress,
    TaskReady,
    TaskRunning,
    Timer,
    TimerFired,
)
from workflows.domain.run.job import decide
from workflows.domain.run.status import JobRecord, TaskState
from workflows.domain.run.tasks import new_job
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def at(second: float) -> datetime:
    return T0 + timedelta(seconds=second)


def run(replicas: int = 1, gang: bool = False, **group: Any) -> JobRecord:
    """A run of protocol 5 created at 1 s: its workers wait for room."""
    fields = {"name": "w", "replicas": replicas, "command": ["x"], **group}
    job = new_job(parse_spec({"name": "r", "gang": gang, "groups": [fields]}), Settings(), T0)
    job.protocol = 5
    job, _ = decide(job, [Created()], at(1))
    return job


def then(job: JobRecord, second: float, *events: Event) -> JobRecord:
    job, _ = decide(job, list(events), at(second))
    return job


def placed(task: str = "w-0", node: str = "n0", attempt: int = 0) -> PlacementUpdate:
    return PlacementUpdate(task_id=task, attempt=attempt, node=node, address="10.0.0.1")


def started(task: str = "w-0", attempt: int = 0) -> TaskRunning:
    return TaskRunning(task_id=task, attempt=attempt, started=True)


def said(commands: list[Command]) -> list[tuple[Any, ...]]:
    """Each command as a line: what, which worker and attempt, where or when (seconds after T0)."""
    lines: list[tuple[Any, ...]] = []
    for command in commands:
        match command:
            case Place(requests=requests):
                lines.append(("place", *[(r.task_id, r.attempt) for r in requests]))
            case PlanGroup(group=group):
                lines.append(("plan", group))
            case Start(barrier=True):
                lines.append(("set up", command.task_id, command.attempt, command.node))
            case Start():
                lines.append(("start", command.task_id, command.attempt, command.node))
            case Supervise():
                lines.append(("supervise", command.task_id, command.attempt, command.node))
            case Stop():
                lines.append(("stop", command.task_id, command.attempt, command.node))
            case Release():
                lines.append(("release", command.task_id, command.attempt))
            case ArmTimer():
                seconds = (command.at - T0).total_seconds()
                lines.append((f"{command.timer.value} timer", command.task_id, command.attempt, seconds))
    return lines


# ---- state by state ------------------------------------------------------------------------------------------------


def test_workers_that_wait_ask_for_room_in_one_request() -> None:
    assert said(effects(run(2), at(5))) == [("place", ("w-0", 0), ("w-1", 0))]


def test_a_group_not_planned_yet_is_asked_about_and_a_group_waiting_for_another_asks_nothing() -> None:
    spec = parse_spec(
        {
            "name": "r",
            "groups": [
                {"name": "w", "command": ["x"], "total_gpus": 8},
                {"name": "after", "command": ["x"], "depends_on": [{"group": "w"}]},
            ],
        }
    )
    job = new_job(spec, Settings(), T0)
    job.protocol = 5
    job = then(job, 1, Created())
    assert said(effects(job, at(5))) == [("plan", "w")]


def test_a_worker_placed_but_not_picked_up_is_started_again_and_asks_no_room() -> None:
    job = then(run(2), 2, placed("w-0"))
    assert job.task("w-0").placed_pending
    assert said(effects(job, at(5))) == [("place", ("w-1", 0)), ("start", "w-0", 0, "n0")]


def test_a_worker_being_set_up_is_started_again_which_finds_its_own() -> None:
    job = then(run(), 2, placed())
    job = then(job, 3, TaskProgress(task_id="w-0", attempt=0, reason=Reason("PullingImage", "Pulling image x")))
    assert job.task("w-0").state in (TaskState.PREPARING, TaskState.PULLING)
    assert said(effects(job, at(5))) == [("start", "w-0", 0, "n0")]


def test_a_gang_at_its_barrier_arms_the_barrier_and_sets_up_who_is_not_ready() -> None:
    job = then(run(2, gang=True), 2, placed("w-0"), placed("w-1", "n1"))
    job = then(job, 3, TaskReady(task_id="w-0", attempt=0))
    assert job.task("w-0").state is TaskState.READY_TO_START
    assert job.barrier_since == at(3)
    # The member at the barrier has nothing to watch; the barrier times out 900 s after the first arrived.
    assert said(effects(job, at(5))) == [("barrier timer", "", 0, 903.0), ("set up", "w-1", 0, "n1")]


def test_a_gang_whose_barrier_opened_starts_its_members_not_started_yet() -> None:
    job = then(run(2, gang=True), 2, placed("w-0"), placed("w-1", "n1"))
    job = then(job, 3, TaskReady(task_id="w-0", attempt=0), TaskReady(task_id="w-1", attempt=0))
    assert job.barrier_since is None and job.barrier_round == 1
    assert said(effects(job, at(5))) == [("start", "w-0", 0, "n0"), ("start", "w-1", 0, "n1")]


def test_a_running_worker_is_supervised_and_its_time_limit_armed_from_when_it_ran() -> None:
    job = then(then(run(time_limit_seconds=3600), 2, placed()), 3, started())
    assert said(effects(job, at(5))) == [("supervise", "w-0", 0, "n0"), ("time_limit timer", "w-0", 0, 3603.0)]


def test_a_worker_running_after_a_restart_arms_its_reset() -> None:
    job = then(then(run(), 2, placed()), 3, started())
    job = then(job, 4, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    job = then(job, 14, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    job = then(then(job, 15, placed(attempt=1)), 16, started(attempt=1))
    assert job.task("w-0").restarts == 1
    assert said(effects(job, at(20))) == [("supervise", "w-0", 1, "n0"), ("reset timer", "w-0", 1, 616.0)]


def test_a_stale_worker_arms_its_heartbeat_ttl() -> None:
    job = then(then(run(time_limit_seconds=3600), 2, placed()), 3, started())
    job = then(job, 20, HeartbeatLate(task_id="w-0", attempt=0))
    assert job.task("w-0").state is TaskState.STALE
    assert said(effects(job, at(25))) == [
        ("supervise", "w-0", 0, "n0"),
        ("time_limit timer", "w-0", 0, 3603.0),
        ("stale_ttl timer", "w-0", 0, 80.0),
    ]


def test_a_stopping_worker_is_stopped_again_and_watched_until_it_ends() -> None:
    job = then(then(run(time_limit_seconds=3600), 2, placed()), 3, started())
    job = then(job, 4, StopRequested(task_id="w-0"))
    assert job.task("w-0").state is TaskState.STOPPING
    assert said(effects(job, at(5))) == [("supervise", "w-0", 0, "n0"), ("stop", "w-0", 0, "n0")]


def test_a_worker_in_back_off_arms_its_restart() -> None:
    job = then(then(run(), 2, placed()), 3, started())
    job = then(job, 4, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    assert job.task("w-0").restart_at == at(14)
    assert said(effects(job, at(5))) == [("restart timer", "w-0", 0, 14.0)]


def test_a_timer_past_due_fires_at_once() -> None:
    job = then(then(run(time_limit_seconds=60), 2, placed()), 3, started())
    assert said(effects(job, at(500))) == [("supervise", "w-0", 0, "n0"), ("time_limit timer", "w-0", 0, 500.0)]


def test_an_ended_run_needs_nothing() -> None:
    job = then(then(run(), 2, placed()), 3, started())
    job = then(job, 4, CancelRequested())
    job = then(job, 5, TaskEnded(task_id="w-0", attempt=0, exit_code=143))
    assert job.task("w-0").final
    assert effects(job, at(6)) == []


# ---- identities ----------------------------------------------------------------------------------------------------


def test_a_start_and_a_supervisor_of_one_attempt_are_one_effect_and_a_gang_members_set_up_another() -> None:
    start = Start(task_id="w-0", attempt=0, node="n0", group=run().spec.groups[0])
    assert identity(start) == identity(Supervise(task_id="w-0", attempt=0, node="n0")) == [Effect("run", "w-0", 0)]
    assert identity(start.model_copy(update={"barrier": True})) == [Effect("setup", "w-0", 0)]
    arm = ArmTimer(timer=Timer.RESTART, task_id="w-0", attempt=0, at=at(1))
    assert identity(arm) == identity(arm.model_copy(update={"at": at(2)}))  # when is not what


def test_the_difference_keeps_what_is_not_in_flight_and_the_difference_from_nothing_is_everything() -> None:
    job = then(then(run(3), 2, placed("w-0")), 3, started("w-0"))
    needed = effects(job, at(5))
    assert difference(needed, set()) == needed
    in_flight = {Effect("place", "w-1", 0), Effect("run", "w-0", 0)}
    assert said(difference(needed, in_flight)) == [("place", ("w-2", 0))]


# ---- what a live run of protocol 6 carries out besides the difference ----------------------------------------------


def test_a_release_is_done_once_beside_the_difference_and_a_timer_made_moot_in_the_same_decision_is_dropped() -> None:
    job = then(run(time_limit_seconds=3600), 2, placed())
    # Reported running and ended in one decision: the time limit armed as it ran is moot at once.
    job, commands = decide(job, [started(), TaskEnded(task_id="w-0", attempt=0, exit_code=0)], at(3))
    assert ("time_limit timer", "w-0", 0, 3603.0) in said(commands)
    assert said(one_offs(commands, identities(effects(job, at(3))))) == [("release", "w-0", 0)]


def test_a_live_run_needs_no_watcher_for_a_gang_member_stopped_at_the_barrier() -> None:
    job = then(run(2, gang=True), 2, placed("w-0"), placed("w-1", "n1"))
    job = then(job, 3, TaskReady(task_id="w-0", attempt=0), StopRequested(task_id="w-0"))
    assert job.task("w-0").state is TaskState.STOPPING
    assert Effect("run", "w-0", 0) in identities(effects(job, at(5)))  # a new run watches it
    assert covered_in_a_live_run(job) == {Effect("run", "w-0", 0)}


# ---- decide issues what each decision newly needs -------------------------------------------------------------------


def _spec(policy: str, gang: bool, limit: bool) -> dict[str, Any]:
    group: dict[str, Any] = {"name": "w", "replicas": 2, "command": ["x"], "restart_policy": policy}
    if limit:
        group["time_limit_seconds"] = 30
    return {"name": "p", "gang": gang, "groups": [group]}


def newly_needed(before: JobRecord, after: JobRecord, now: datetime) -> set[Effect]:
    """What the record after a decision needs that the record before did not (so was not in flight)."""
    return identities(effects(after, now)) - identities(effects(before, now))


def once(after: JobRecord, effect: Effect) -> bool:
    """What `decide` issues that no record needs in flight: what follows one transition, done once (a release; the
    stop sent to the machine of a worker placed but not picked up, Cancelled or queued again at once; a replan,
    which a new run asks for at once), and timers a later move of the same decision made moot (the barrier opened
    as the member that armed it arrived; a worker ended as its running was reported)."""
    if effect.kind in ("release", "stop"):
        return effect.kind == "release" or not _on_node(after, effect)
    if effect.kind != "timer":
        return False
    if effect.timer == Timer.BARRIER.value:
        return after.barrier_since is None or after.barrier_round != effect.attempt
    if effect.timer == Timer.REPLAN.value:
        return True
    task = after.task(effect.task)
    running = task.state in (TaskState.RUNNING, TaskState.STALE)
    return effect.timer != Timer.RESTART.value and (task.attempt.number != effect.attempt or not running)


def _on_node(job: JobRecord, effect: Effect) -> bool:
    task = job.task(effect.task)
    return task.attempt.number == effect.attempt and task.on_node


def exempt(after: JobRecord, effect: Effect) -> bool:
    """What a new run carries out that `decide` never issues (a new run knows less of what is in flight):
    - a worker stopped at the barrier (nothing runs) is watched until it ends: the stop's own confirmation reaches
      only the workflow run that sent it (JobWorkflow._stop), a new run's supervisor finds nothing and says so;
    - a worker stopped for a gang restart (RestartJob) carries the failed worker's back-off (`restart_at`), whose
      timer a new run arms for it too: either timer queues them all (`job._gang_waiting`), whichever fires first."""
    if effect.kind == "run":
        return after.task(effect.task).state is TaskState.STOPPING
    if effect.kind == "timer" and effect.timer == Timer.RESTART.value:
        stop = after.task(effect.task).stop
        return stop is not None and stop.cause == "gang_restart"
    return False


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.sampled_from(["OnFailure", "Always", "Never"]), st.booleans(), st.booleans(), choices)
def test_what_a_decision_issues_is_what_its_record_newly_needs_but_for_what_is_done_once(
    policy: str, gang: bool, limit: bool, picks: list[tuple[int, int]]
) -> None:
    """Played as in test_job_properties: what the record before a decision needed is what was in flight; what
    `decide` returns (but for what is done once) is exactly what the record after it needs besides (but for what
    only a new run carries out): so the running run and a run continued as new carry out the same effects."""
    job = new_job(parse_spec(_spec(policy, gang, limit)), SHRUNK, T0)
    job.protocol = 5
    for step in played(job, picks):
        after, event = step.after, step.event
        issued = {e for e in identities(step.commands) if not once(after, e)}
        needed = newly_needed(step.before, after, step.now)
        assert issued <= needed, f"after {event!r}: decide issued {sorted(issued - needed)}, needed by nothing"
        missing = {e for e in needed - issued if not exempt(after, e)}
        assert not missing, f"after {event!r}: the record needs {sorted(missing)}, which decide did not issue"
