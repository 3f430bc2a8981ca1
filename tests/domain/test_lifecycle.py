"""The worker state machine against the spec's diagram, and the run state derived from its workers."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from workflows.domain.reasons import R, Reason
from workflows.domain.run.lifecycle import TRANSITIONS, InvalidTransition, TaskEvent, derive_run, next_state
from workflows.domain.run.status import Attempt, Final, LastFailure, RunState, Status, TaskRecord, TaskState

S, E = TaskState, TaskEvent
T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)

# Written by hand from the spec's worker diagram, its Liveness table and its Stop text, one row per edge.
# "Active" and "placed" states are those on a machine: Preparing, Pulling, ReadyToStart, Starting, Running, Stale.
PLACED = (S.PREPARING, S.PULLING, S.READY_TO_START, S.STARTING, S.RUNNING, S.STALE)
SPEC_EDGES: list[tuple[TaskState, TaskEvent, TaskState, str]] = [
    (S.PENDING, E.PICKED_UP, S.PREPARING, "placed, machine picks it up"),
    # Protocol 4 and earlier: placed and picked up in one step.
    (S.PENDING, E.PLACED, S.PREPARING, "placed, machine picks it up (protocol 4 and earlier)"),
    (S.PREPARING, E.PULL, S.PULLING, "preparing pulls the image"),
    (S.PREPARING, E.CONTAINER_STARTED, S.STARTING, "preparing starts the container"),
    (S.PULLING, E.CONTAINER_STARTED, S.STARTING, "pulled, the container starts"),
    (S.PREPARING, E.READY, S.READY_TO_START, "a gang member set up waits at the barrier"),
    (S.PULLING, E.READY, S.READY_TO_START, "a gang member pulled waits at the barrier"),
    (S.READY_TO_START, E.BARRIER_RELEASED, S.STARTING, "every member ready, the barrier opens"),
    (S.STARTING, E.CONTAINER_RUNNING, S.RUNNING, "the machine reports it running"),
    (S.RUNNING, E.HEARTBEAT_LATE, S.STALE, "heartbeat late"),
    (S.STALE, E.HEARTBEAT_BACK, S.RUNNING, "heartbeat back"),
    (S.STALE, E.TTL_EXPIRED, S.DOWN, "no heartbeat for its TTL"),
    (S.RUNNING, E.EXITED_ZERO, S.COMPLETED, "exit 0"),
    (S.RUNNING, E.EXITED_NONZERO, S.FAILED, "exit other than 0, or OOM"),
    (S.PREPARING, E.SETUP_FAILED, S.FAILED, "image, config, start errors"),
    (S.PULLING, E.SETUP_FAILED, S.FAILED, "the pull failed"),
    (S.PENDING, E.STOP, S.CANCELLED, "stopped before placement (or before its machine picked it up)"),
    (S.STOPPING, E.STOP_CONFIRMED, S.CANCELLED, "the machine confirmed the stop"),
    (S.STOPPING, E.MACHINE_LOST, S.CANCELLED, "machine lost while stopping"),
    (S.STOPPING, E.MACHINE_REMOVED, S.CANCELLED, "machine removed from the cluster while stopping"),
    (S.FAILED, E.RESTART, S.PENDING, "failed, restarted by policy"),
    (S.DOWN, E.RESTART, S.PENDING, "down, restarted by policy"),
    (S.COMPLETED, E.RESTART, S.PENDING, "completed, restart_policy Always"),
    (S.CANCELLED, E.REQUEUE, S.PENDING, "preempted, queued again"),
    # The spec's "Preparing --> Failed: start errors" where a gang member's start happens: after the barrier.
    (S.READY_TO_START, E.SETUP_FAILED, S.FAILED, "a gang member's start failed once the barrier opened"),
    # Astraeus addition (workflows/README.md): lost with its machine, which came back and read its exit 0 back.
    (S.DOWN, E.EXITED_ZERO, S.COMPLETED, "lost with its machine, which says it had exited 0 meanwhile"),
]
for _state in PLACED:
    SPEC_EDGES += [
        (_state, E.STOP, S.STOPPING, f"a stop moves {_state} to Stopping"),
        (_state, E.MACHINE_LOST, S.DOWN, f"machine lost while {_state}"),
        (_state, E.MACHINE_REMOVED, S.DOWN, f"machine removed while {_state}"),
    ]
SPEC_TABLE = {(state, event): target for state, event, target, _ in SPEC_EDGES}


@pytest.mark.parametrize(
    ("state", "event", "target"),
    [pytest.param(s, e, t, id=f"{s} to {t}: {why}") for s, e, t, why in SPEC_EDGES],
)
def test_every_edge_of_the_spec_is_in_the_table(state: TaskState, event: TaskEvent, target: TaskState) -> None:
    assert TRANSITIONS[(state, event)] is target
    assert next_state(state, event) is target


def test_the_table_has_no_edge_the_spec_does_not_draw() -> None:
    assert set(TRANSITIONS) - set(SPEC_TABLE) == set()


NOT_EDGES = [(s, e) for s in TaskState for e in TaskEvent if (s, e) not in SPEC_TABLE]


@pytest.mark.parametrize(("state", "event"), [pytest.param(s, e, id=f"{s} cannot take {e}") for s, e in NOT_EDGES])
def test_every_other_pair_raises(state: TaskState, event: TaskEvent) -> None:
    with pytest.raises(InvalidTransition) as raised:
        next_state(state, event)
    assert str(raised.value) == f"a worker in {state} cannot take {event}"


def test_every_state_is_reachable_from_pending() -> None:
    seen, frontier = {S.PENDING}, [S.PENDING]
    while frontier:
        state = frontier.pop()
        for (source, _), target in TRANSITIONS.items():
            if source is state and target not in seen:
                seen.add(target)
                frontier.append(target)
    assert seen == set(TaskState)


@pytest.mark.parametrize(
    ("state", "ways_out"),
    [
        pytest.param(S.COMPLETED, {(E.RESTART, S.PENDING)}, id="completed leaves only by a restart"),
        pytest.param(S.FAILED, {(E.RESTART, S.PENDING)}, id="failed leaves only by a restart"),
        pytest.param(
            S.DOWN,
            {(E.RESTART, S.PENDING), (E.EXITED_ZERO, S.COMPLETED)},
            id="down leaves by a restart, or completes when its machine says it had exited 0",
        ),
        pytest.param(S.CANCELLED, {(E.REQUEUE, S.PENDING)}, id="cancelled leaves only when requeued"),
    ],
)
def test_an_ended_worker_leaves_only_to_pending(state: TaskState, ways_out: set[tuple[TaskEvent, TaskState]]) -> None:
    assert {(event, target) for (source, event), target in TRANSITIONS.items() if source is state} == ways_out


# ---- derive_run -----------------------------------------------------------------------------------------------


def worker(
    index: int,
    state: TaskState,
    reason: str,
    *,
    final: bool = False,
    node: str | None = "n0",
    failure: str | None = None,
    code: str = "Test",
) -> TaskRecord:
    """A worker record built directly, as `decide` would leave it."""
    last_failure = LastFailure(exit_code=3, reason=failure, log_tail="boom\n") if failure else None
    return TaskRecord(
        id=f"w-{index}",
        group="w",
        index=index,
        attempt=Attempt(node=node),
        after=Final() if final else None,
        status=Status(state=state, reason=reason, code=code, created_at=T0),
        last_failure=last_failure,
    )


RUNNING = "Container running"
WAITING = "Waiting for workers to start"
EXIT_3 = "Exited with code 3"

DERIVE_CASES = [
    pytest.param(
        [
            worker(0, S.COMPLETED, "Exited with code 0", final=True),
            worker(1, S.COMPLETED, "Exited with code 0", final=True),
        ],
        RunState.RUNNING,
        False,
        (RunState.COMPLETED, "All workers completed"),
        id="every worker completed completes the run",
    ),
    pytest.param(
        [worker(0, S.FAILED, EXIT_3, final=True, failure=EXIT_3), worker(1, S.RUNNING, RUNNING, node="n1")],
        RunState.RUNNING,
        False,
        (RunState.FAILED, "Worker w-0 failed on n0: Exited with code 3"),
        id="one worker failed for good fails the run naming worker machine and why",
    ),
    pytest.param(
        [worker(0, S.FAILED, "Retry budget exhausted after 10/10 restarts", final=True, failure=EXIT_3)],
        RunState.PENDING,
        False,
        (RunState.FAILED, "Worker w-0 failed on n0: Retry budget exhausted after 10/10 restarts"),
        id="the run names the worker's final reason, the spent budget",
    ),
    pytest.param(
        [worker(0, S.FAILED, "ErrImagePull: manifest unknown", final=True)],
        RunState.PENDING,
        False,
        (RunState.FAILED, "Worker w-0 failed on n0: ErrImagePull: manifest unknown"),
        id="a worker that never started fails the run with its setup error",
    ),
    pytest.param(
        [worker(0, S.DOWN, "Machine lost: its lease expired", final=True), worker(1, S.RUNNING, RUNNING)],
        RunState.RUNNING,
        False,
        (RunState.FAILED, "Worker w-0 was lost on n0: Machine lost: its lease expired"),
        id="a worker lost for good fails the run as lost",
    ),
    pytest.param(
        [
            worker(0, S.FAILED, EXIT_3, final=True, failure=EXIT_3),
            worker(1, S.FAILED, "OOMKilled: the container exceeded its memory limit", final=True, node="n1"),
            worker(2, S.RUNNING, RUNNING),
        ],
        RunState.RUNNING,
        False,
        (RunState.FAILED, "2 of 3 workers failed; the first: Worker w-0 failed on n0: Exited with code 3"),
        id="two failed workers are counted and the first is named",
    ),
    pytest.param(
        [
            worker(0, S.COMPLETED, "Exited with code 0", final=True),
            worker(1, S.CANCELLED, "Stopped on request", final=True),
        ],
        RunState.RUNNING,
        False,
        (RunState.CANCELLED, "All workers ended; some were cancelled"),
        id="every worker ended with one cancelled cancels the run",
    ),
    pytest.param(
        [worker(0, S.RUNNING, RUNNING), worker(1, S.PENDING, WAITING, node=None)],
        RunState.PENDING,
        False,
        (RunState.RUNNING, "1 of 2 workers running"),
        id="one running worker of two runs the run",
    ),
    pytest.param(
        [worker(0, S.STALE, "Heartbeat lease expired"), worker(1, S.RUNNING, RUNNING)],
        RunState.RUNNING,
        False,
        (RunState.RUNNING, "2 of 2 workers running"),
        id="a stale worker still counts as running",
    ),
    pytest.param(
        [worker(0, S.COMPLETED, "Exited with code 0", final=True), worker(1, S.RUNNING, RUNNING)],
        RunState.RUNNING,
        False,
        (RunState.RUNNING, "1 of 2 workers running"),
        id="a completed worker no longer counts as running",
    ),
    pytest.param(
        [
            worker(0, S.PREPARING, "Placed on n0"),
            worker(1, S.PENDING, "No machine fits: 0 of 1 machines ready", node=None, code="NoMachineFits"),
        ],
        RunState.PENDING,
        False,
        (RunState.PENDING, "No machine fits: 0 of 1 machines ready"),
        id="a pending run shows why its first worker waiting for a machine waits",
    ),
    pytest.param(
        [worker(0, S.PREPARING, "Placed on n0"), worker(1, S.STARTING, "Container started")],
        RunState.PENDING,
        False,
        (RunState.PENDING, "Placed on n0"),
        id="with every worker placed the run shows its first waiting worker's reason",
    ),
    pytest.param(
        [worker(0, S.FAILED, EXIT_3, failure=EXIT_3), worker(1, S.PENDING, WAITING, node=None)],
        RunState.RUNNING,
        False,
        (RunState.PENDING, WAITING),
        id="a worker that waits out its back-off does not fail the run",
    ),
    pytest.param(
        [worker(0, S.DOWN, "Machine lost: its lease expired")],
        RunState.RUNNING,
        False,
        (RunState.PENDING, "Machine lost: its lease expired"),
        id="a lost worker that will restart leaves the run pending with its reason",
    ),
    pytest.param(
        [worker(0, S.STOPPING, "Stopped by scheduler"), worker(1, S.PENDING, WAITING, node=None)],
        RunState.RUNNING,
        False,
        None,
        id="a run keeps what it shows while a worker stops",
    ),
    pytest.param(
        [worker(0, S.STOPPING, "Run cancelled"), worker(1, S.CANCELLED, "Run cancelled", final=True)],
        RunState.RUNNING,
        True,
        None,
        id="a cancelled run keeps its state until every worker is gone",
    ),
    pytest.param(
        [worker(0, S.CANCELLED, "Stopped on request", final=True), worker(1, S.CANCELLED, "Run cancelled", final=True)],
        RunState.RUNNING,
        True,
        (RunState.CANCELLED, "All workers ended; some were cancelled"),
        id="a cancelled run ends cancelled once every worker is gone",
    ),
    pytest.param(
        [worker(0, S.COMPLETED, "Exited with code 0", final=True)],
        RunState.COMPLETED,
        False,
        None,
        id="a completed run stays as it is",
    ),
    pytest.param(
        [worker(0, S.CANCELLED, "Stopped on request", final=True)],
        RunState.CANCELLED,
        True,
        None,
        id="a cancelled run stays as it is",
    ),
    pytest.param([], RunState.PENDING, False, None, id="a run without workers yet keeps what it shows"),
]


@pytest.mark.parametrize(("tasks", "current", "cancel_requested", "expected"), DERIVE_CASES)
def test_derive_run(
    tasks: list[TaskRecord],
    current: RunState,
    cancel_requested: bool,
    expected: tuple[RunState, str] | None,
) -> None:
    derived = derive_run(tasks, current, cancel_requested)
    assert (derived if derived is None else (derived[0], derived[1].text)) == expected


@pytest.mark.parametrize(
    ("tasks", "code"),
    [
        pytest.param(
            [worker(0, S.COMPLETED, "Exited with code 0", final=True)], R.AllWorkersCompleted.code, id="completed"
        ),
        pytest.param([worker(0, S.FAILED, EXIT_3, final=True)], R.WorkerFailed.code, id="failed"),
        pytest.param([worker(0, S.DOWN, "Machine lost: its lease expired", final=True)], R.WorkerLost.code, id="lost"),
        pytest.param([worker(0, S.RUNNING, RUNNING)], R.WorkersRunning.code, id="running"),
        pytest.param(
            [worker(0, S.PENDING, "Queued behind pretrain", node=None, code="QueuedBehind")],
            "QueuedBehind",
            id="pending keeps the waiting worker's code",
        ),
    ],
)
def test_derived_reasons_carry_their_code(tasks: list[TaskRecord], code: str) -> None:
    derived = derive_run(tasks, RunState.PENDING)
    assert derived is not None
    assert derived[1].code == code


def test_a_worker_without_a_machine_fails_without_naming_one() -> None:
    derived = derive_run([worker(0, S.FAILED, "Invalid task: bad mount", final=True, node=None)], RunState.PENDING)
    assert derived is not None
    assert derived[1] == Reason("WorkerFailedNowhere", "Worker w-0 failed: Invalid task: bad mount")


def test_a_cancelled_run_stays_cancelled() -> None:
    tasks = [
        worker(0, S.FAILED, "Run cancelled", final=True, failure=EXIT_3),
        worker(1, S.CANCELLED, "Stopped on request", final=True),
    ]
    assert derive_run(tasks, RunState.CANCELLED, cancel_requested=True) is None
