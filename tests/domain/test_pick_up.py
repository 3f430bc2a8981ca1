"""Protocol 5: a placed worker stays Pending ("Placed on <machine>") until its machine picks it up; the machine's
reports say when, and the worker's history gets each entry at the time it happened."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from workflows.domain.reasons import Reason
from workflows.domain.run.effects import effects
from workflows.domain.run.events import (
    CancelRequested,
    Command,
    Created,
    Event,
    MachineLost,
    Place,
    PlacementUpdate,
    Preempt,
    Release,
    Start,
    Stop,
    TaskProgress,
    TaskReady,
    TaskRunning,
    TaskSetupFailed,
)
from workflows.domain.run.job import decide
from workflows.domain.run.status import JobRecord
from workflows.domain.run.tasks import new_job
from workflows.domain.run.views import describe
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def at(second: float) -> datetime:
    return T0 + timedelta(seconds=second)


def run(replicas: int = 1, protocol: int = 5, **fields: Any) -> JobRecord:
    """A run created at 1 s whose workers were placed on n0, n1, ... at 2 s."""
    spec = parse_spec({"name": "r", "groups": [{"name": "w", "replicas": replicas, "command": ["x"]}], **fields})
    job = new_job(spec, Settings(), T0)
    job.protocol = protocol
    job, _ = decide(job, [Created()], at(1))
    placed = [PlacementUpdate(task_id=f"w-{i}", attempt=0, node=f"n{i}", address="10.0.0.1") for i in range(replicas)]
    job, _ = decide(job, list(placed), at(2))
    return job


def step(job: JobRecord, second: float, *events: Event) -> tuple[JobRecord, list[Command]]:
    return decide(job, list(events), at(second))


def entries(job: JobRecord, task: str = "w-0") -> list[tuple[str, str, float]]:
    """The worker's history: state, reason, and the second it happened."""
    return [(e.state, e.reason, (e.at - T0).total_seconds()) for e in job.task(task).history]


PLACED = [("Pending", "Waiting for workers to start", 1.0), ("Pending", "Placed on n0", 2.0)]


def test_a_placed_worker_is_pending_on_its_machine_until_picked_up() -> None:
    job = run()
    task = job.task("w-0")
    assert entries(job) == PLACED
    assert (task.node, task.placed_pending, task.waiting, task.on_node) == ("n0", True, False, True)
    assert (job.status.state, job.status.reason) == ("Pending", "Placed on n0")
    shown = describe(job).tasks[0]
    assert (shown.status.state, shown.node) == ("Pending", "n0")


def test_placing_it_starts_it_on_its_machine() -> None:
    spec = parse_spec({"name": "r", "groups": [{"name": "w", "command": ["x"]}]})
    job = new_job(spec, Settings(), T0)
    job.protocol = 5
    job, _ = decide(job, [Created()], at(1))
    _, commands = step(job, 2, PlacementUpdate(task_id="w-0", attempt=0, node="n0"))
    assert [(type(c).__name__, getattr(c, "node", None)) for c in commands] == [("Start", "n0")]


def test_protocol_3_runs_keep_going_preparing_when_placed() -> None:
    job = run(protocol=3)
    assert entries(job)[-1] == ("Preparing", "Placed on n0", 2.0)


# (report, the worker's entries after the Pending ones). The run decides each report at 10 s.
QUICK_AND_SLOW: list[tuple[str, list[Event], list[tuple[str, str, float]]]] = [
    (
        "a quick start: one report says when it was picked up and started, then it runs",
        [TaskRunning(task_id="w-0", attempt=0, started=True, picked_up_at=at(3), started_at=at(4))],
        [
            ("Preparing", "Picked up by n0", 3.0),
            ("Starting", "Container started", 4.0),
            ("Running", "Container running", 10.0),
        ],
    ),
    (
        "a slow start: told picked up while it is set up, then started and running",
        [
            TaskProgress(task_id="w-0", attempt=0, reason=Reason("PickedUp", "Picked up by n0"), picked_up_at=at(3)),
            TaskRunning(task_id="w-0", attempt=0, started=True, picked_up_at=at(3), started_at=at(8)),
        ],
        [
            ("Preparing", "Picked up by n0", 3.0),
            ("Starting", "Container started", 8.0),
            ("Running", "Container running", 10.0),
        ],
    ),
    (
        "a wait: picked up, then Preparing with the machine's reason",
        [
            TaskProgress(
                task_id="w-0",
                attempt=0,
                reason=Reason("WaitingForRegistrySecret", "waiting for registry secret reg to be synced to this node"),
                picked_up_at=at(3),
            )
        ],
        [
            ("Preparing", "Picked up by n0", 3.0),
            ("Preparing", "waiting for registry secret reg to be synced to this node", 10.0),
        ],
    ),
    (
        "a pull: picked up, then Pulling",
        [
            TaskProgress(
                task_id="w-0", attempt=0, pulling=True, reason=Reason("Pulling", "Pulling img:1"), picked_up_at=at(3)
            )
        ],
        [("Preparing", "Picked up by n0", 3.0), ("Pulling", "Pulling img:1", 10.0)],
    ),
    (
        "a setup that fails: picked up, then Failed (the spec's Preparing -> Failed)",
        [TaskSetupFailed(task_id="w-0", attempt=0, reason=Reason("InvalidTask", "Invalid task: /etc"))],
        [("Preparing", "Picked up by n0", 10.0), ("Failed", "Invalid task: /etc", 10.0)],
    ),
    (
        "a machine's clock behind the run's: never before its placement",
        [TaskRunning(task_id="w-0", attempt=0, started=True, picked_up_at=at(-60), started_at=at(-59))],
        [
            ("Preparing", "Picked up by n0", 2.0),
            ("Starting", "Container started", 2.0),
            ("Running", "Container running", 10.0),
        ],
    ),
    (
        "a machine's clock ahead of the run's: never after now",
        [TaskRunning(task_id="w-0", attempt=0, started=True, picked_up_at=at(60), started_at=at(61))],
        [
            ("Preparing", "Picked up by n0", 10.0),
            ("Starting", "Container started", 10.0),
            ("Running", "Container running", 10.0),
        ],
    ),
    (
        "an agent that says no time (before protocol 5): now",
        [TaskRunning(task_id="w-0", attempt=0, started=True)],
        [
            ("Preparing", "Picked up by n0", 10.0),
            ("Starting", "Container started", 10.0),
            ("Running", "Container running", 10.0),
        ],
    ),
    (
        "a second pick-up report changes nothing",
        [
            TaskProgress(task_id="w-0", attempt=0, reason=Reason("PickedUp", "Picked up by n0"), picked_up_at=at(3)),
            TaskProgress(task_id="w-0", attempt=0, reason=Reason("PickedUp", "Picked up by n0"), picked_up_at=at(3)),
        ],
        [("Preparing", "Picked up by n0", 3.0)],
    ),
]


@pytest.mark.parametrize(("events", "after"), [pytest.param(e, a, id=why) for why, e, a in QUICK_AND_SLOW if why])
def test_the_machine_picks_it_up(events: list[Event], after: list[tuple[str, str, float]]) -> None:
    job = run()
    for event in events:
        job, _ = step(job, 10, event)
    assert entries(job) == PLACED + after


def test_a_pick_up_report_after_it_started_is_ignored() -> None:
    job = run()
    job, _ = step(job, 5, TaskRunning(task_id="w-0", attempt=0, started=True, picked_up_at=at(3), started_at=at(4)))
    before = job.model_dump()
    late = TaskProgress(task_id="w-0", attempt=0, reason=Reason("PickedUp", "Picked up by n0"), picked_up_at=at(3))
    job, commands = step(job, 6, late)
    assert (commands, job.model_dump()) == ([], before)


def test_the_same_grant_again_or_a_stale_waiting_answer_changes_nothing() -> None:
    job = run()
    before = job.model_dump()
    for answer in (
        PlacementUpdate(task_id="w-0", attempt=0, node="n0"),
        PlacementUpdate(
            task_id="w-0", attempt=0, reason=Reason("NoMachineFits", "No machine fits: 0 of 1 machines ready")
        ),
    ):
        job, commands = step(job, 3, answer)
        assert (commands, job.model_dump()) == ([], before)


def test_cancelled_before_its_machine_picked_it_up_it_is_stopped_there_too() -> None:
    job, commands = step(run(), 3, CancelRequested())
    assert entries(job)[-1] == ("Cancelled", "Run cancelled", 3.0)
    assert commands == [Stop(task_id="w-0", attempt=0, node="n0"), Release(task_id="w-0", attempt=0)]
    assert job.task("w-0").final
    assert (job.status.state, job.status.reason) == ("Cancelled", "All workers ended; some were cancelled")


def test_preempted_before_its_machine_picked_it_up_it_queues_again_at_once() -> None:
    job, commands = step(run(), 3, Preempt(task_ids=["w-0"], by="urgent"))
    assert entries(job)[2:] == [
        ("Cancelled", "Preempted by higher-priority work (urgent)", 3.0),
        ("Pending", "Preempted by urgent; queued again", 3.0),
    ]
    task = job.task("w-0")
    assert (task.attempt.number, task.node, task.restarts, task.final) == (1, None, 0, False)
    assert [type(c).__name__ for c in commands] == ["Stop", "Release", "Place"]
    assert (commands[0], commands[1]) == (Stop(task_id="w-0", attempt=0, node="n0"), Release(task_id="w-0", attempt=0))
    place = commands[2]
    assert isinstance(place, Place) and [(r.task_id, r.attempt) for r in place.requests] == [("w-0", 1)]
    assert (job.status.state, job.status.reason) == (
        "Pending",
        "Preempted by higher-priority work (urgent); waiting to run again",
    )


@pytest.mark.parametrize(
    ("removed", "reason"), [(False, "Machine lost: its lease expired"), (True, "Machine removed from the cluster")]
)
def test_its_machine_lost_before_it_picked_it_up_it_waits_for_room_again(removed: bool, reason: str) -> None:
    job, commands = step(run(), 3, MachineLost(node="n0", removed=removed, lost_at=at(2.5)))
    assert entries(job)[-1] == ("Pending", reason, 3.0)
    task = job.task("w-0")
    assert (task.attempt.number, task.node, task.restarts, task.last_failure) == (1, None, 0, None)
    assert [type(c).__name__ for c in commands] == ["Release", "Place"]
    assert commands[0] == Release(task_id="w-0", attempt=0)


def test_a_run_continued_as_new_starts_a_placed_worker_again_and_asks_no_room_for_it() -> None:
    job = run(2)
    job, _ = step(job, 3, TaskRunning(task_id="w-1", attempt=0, started=True, picked_up_at=at(3), started_at=at(3)))
    commands = effects(job, at(4))
    assert [(type(c).__name__, c.task_id) for c in commands if isinstance(c, Start)] == [("Start", "w-0")]
    assert not [c for c in commands if isinstance(c, Place)]


# ---- gangs -------------------------------------------------------------------------------------------------------


def gang(replicas: int = 2) -> JobRecord:
    return run(replicas, gang=True)


def test_a_placed_gang_is_starting_while_its_machines_pick_its_members_up() -> None:
    job = gang()
    assert [t.state for t in job.tasks] == ["Pending", "Pending"]
    assert (job.status.state, job.status.reason) == ("Starting", "Starting together: 0 of 2 ready")


def test_a_gang_member_set_up_goes_preparing_then_waits_at_the_barrier() -> None:
    job, commands = step(gang(), 5, TaskReady(task_id="w-0", attempt=0, picked_up_at=at(3)))
    assert entries(job)[2:] == [
        ("Preparing", "Picked up by n0", 3.0),
        ("ReadyToStart", "Waiting at the gang barrier", 5.0),
    ]
    assert not [c for c in commands if isinstance(c, Start)]  # w-1 is not picked up yet: the barrier stays shut
    assert (job.status.state, job.status.reason) == ("Starting", "Starting together: 1 of 2 ready")
    job, commands = step(job, 6, TaskReady(task_id="w-1", attempt=0, picked_up_at=at(4)))
    assert sorted(c.task_id for c in commands if isinstance(c, Start)) == ["w-0", "w-1"]


def test_a_gang_preempted_while_a_member_was_not_picked_up_leaves_and_comes_back_whole() -> None:
    job, _ = step(gang(), 5, TaskReady(task_id="w-0", attempt=0, picked_up_at=at(3)))
    job, commands = step(job, 6, Preempt(task_ids=["w-0"], by="urgent"))
    assert entries(job, "w-1")[-1] == ("Cancelled", "Preempted by higher-priority work (urgent)", 6.0)
    assert entries(job, "w-0")[-1] == ("Stopping", "Preempted by higher-priority work (urgent)", 6.0)
    assert Stop(task_id="w-1", attempt=0, node="n1") in commands
    assert not [c for c in commands if isinstance(c, Place)]  # not before w-0 is gone: the gang queues whole
