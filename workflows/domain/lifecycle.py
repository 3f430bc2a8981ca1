"""The worker state machine as one table, and the run state derived from its workers."""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from workflows.domain.reasons import R, Reason
from workflows.domain.status import RUN_TERMINAL, TASK_ON_NODE, RunState, TaskRecord, TaskState


class TaskEvent(StrEnum):
    """What can happen to a worker. Each (state, event) pair in TRANSITIONS is one edge of the spec."""

    PLACED = "Placed"
    PULL = "Pull"
    CONTAINER_STARTED = "ContainerStarted"
    READY = "Ready"
    BARRIER_RELEASED = "BarrierReleased"
    CONTAINER_RUNNING = "ContainerRunning"
    HEARTBEAT_LATE = "HeartbeatLate"
    HEARTBEAT_BACK = "HeartbeatBack"
    TTL_EXPIRED = "TtlExpired"
    MACHINE_LOST = "MachineLost"
    MACHINE_REMOVED = "MachineRemoved"
    EXITED_ZERO = "ExitedZero"
    EXITED_NONZERO = "ExitedNonZero"
    SETUP_FAILED = "SetupFailed"
    STOP = "Stop"
    STOP_CONFIRMED = "StopConfirmed"
    RESTART = "Restart"
    REQUEUE = "Requeue"


S, E = TaskState, TaskEvent

TRANSITIONS: dict[tuple[TaskState, TaskEvent], TaskState] = {
    # Placed on a machine; the machine picks it up and sets it up (credentials, drives, network, identity).
    (S.PENDING, E.PLACED): S.PREPARING,
    # Set up; the image is not on the machine, so it is pulled.
    (S.PREPARING, E.PULL): S.PULLING,
    # Set up and the image is there: the container was started.
    (S.PREPARING, E.CONTAINER_STARTED): S.STARTING,
    # The pull finished and the container was started.
    (S.PULLING, E.CONTAINER_STARTED): S.STARTING,
    # Gang member set up: waits at the barrier for every member.
    (S.PREPARING, E.READY): S.READY_TO_START,
    # Gang member pulled its image: waits at the barrier.
    (S.PULLING, E.READY): S.READY_TO_START,
    # Every member of the gang is ready: the barrier opens.
    (S.READY_TO_START, E.BARRIER_RELEASED): S.STARTING,
    # The machine reports the container running (and heartbeats start).
    (S.STARTING, E.CONTAINER_RUNNING): S.RUNNING,
    # Heartbeat late past the grace: Stale.
    (S.RUNNING, E.HEARTBEAT_LATE): S.STALE,
    # Heartbeat again while the machine is up.
    (S.STALE, E.HEARTBEAT_BACK): S.RUNNING,
    # No heartbeat for the worker's full TTL after going stale.
    (S.STALE, E.TTL_EXPIRED): S.DOWN,
    # Exit 0: success.
    (S.RUNNING, E.EXITED_ZERO): S.COMPLETED,
    # Exit other than 0, or OOM.
    (S.RUNNING, E.EXITED_NONZERO): S.FAILED,
    # The image, the config or the container start failed while setting up.
    (S.PREPARING, E.SETUP_FAILED): S.FAILED,
    # The pull failed.
    (S.PULLING, E.SETUP_FAILED): S.FAILED,
    # Stopped before placement: straight to Cancelled.
    (S.PENDING, E.STOP): S.CANCELLED,
    # The machine confirmed the stop.
    (S.STOPPING, E.STOP_CONFIRMED): S.CANCELLED,
    # Restarted by policy after a failure.
    (S.FAILED, E.RESTART): S.PENDING,
    # Restarted by policy after being lost.
    (S.DOWN, E.RESTART): S.PENDING,
    # restart_policy Always restarts completed workers too.
    (S.COMPLETED, E.RESTART): S.PENDING,
    # Preempted: queued again once gone.
    (S.CANCELLED, E.REQUEUE): S.PENDING,
}

for _placed in sorted(TASK_ON_NODE - {S.STOPPING}):
    # "A stop moves a placed worker to Stopping": stop, preemption or time limit.
    TRANSITIONS[(_placed, E.STOP)] = S.STOPPING
    # "any active state: its machine is Down" -> Down (Machine lost: its lease expired).
    TRANSITIONS[(_placed, E.MACHINE_LOST)] = S.DOWN
    # "any active state: its machine was removed" -> Down (Machine removed from the cluster).
    TRANSITIONS[(_placed, E.MACHINE_REMOVED)] = S.DOWN
# A Stopping worker whose machine is lost or removed ends Cancelled (Machine lost while stopping).
TRANSITIONS[(S.STOPPING, E.MACHINE_LOST)] = S.CANCELLED
TRANSITIONS[(S.STOPPING, E.MACHINE_REMOVED)] = S.CANCELLED


class InvalidTransition(ValueError):
    """A (state, event) pair the spec does not allow."""


def next_state(state: TaskState, event: TaskEvent) -> TaskState:
    """The state after `event`; an edge the spec does not draw raises."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(f"a worker in {state} cannot take {event}") from None


_FAILED = (TaskState.FAILED, TaskState.DOWN)


def _failure_sentence(task: TaskRecord) -> Reason:
    """The run's reason for one worker that failed for good."""
    if task.exceeded is not None:
        return R.WorkerTimeLimit(task=task.id, duration=task.exceeded)
    cause = task.status.reason  # its final reason: the exit, or "Retry budget exhausted after 10/10 restarts"
    node = task.node or "no machine"
    if task.state is TaskState.DOWN:
        return R.WorkerLost(task=task.id, node=node, reason=cause)
    return R.WorkerFailed(task=task.id, node=node, reason=cause)


def _waiting_reason(tasks: Sequence[TaskRecord]) -> Reason:
    """A run that runs nothing shows why its first waiting worker waits (a preempted one: why it was)."""
    for task in tasks:
        if task.preempted_by is not None and task.state is TaskState.PENDING:
            cause = R.PreemptedByHigherPriority(run=task.preempted_by).text
            return R.PreemptedWaiting(cause=cause)
    for wanted in (TaskState.PENDING, None):
        for task in tasks:
            if task.final or task.state in (TaskState.RUNNING, TaskState.STALE, TaskState.STOPPING):
                continue
            if wanted is None or task.state is wanted:
                return Reason(task.status.code, task.status.reason)
    return R.WaitingForWorkersToStart()


def derive_run(
    tasks: Sequence[TaskRecord], current: RunState, cancel_requested: bool = False
) -> tuple[RunState, Reason] | None:
    """The run's state and reason from its workers', or None to keep what it shows now.

    Failed as soon as one worker failed for good; Completed or Cancelled once every worker ended for good;
    Running while any worker runs; otherwise Pending with its first waiting worker's reason. A run cancelled
    on request ends Cancelled once its workers are gone.
    """
    if not tasks:
        return None
    if cancel_requested and current not in RUN_TERMINAL:
        return (RunState.CANCELLED, R.SomeCancelled()) if all(t.final for t in tasks) else None
    if current in (RunState.COMPLETED, RunState.CANCELLED):
        return None
    failures = [t for t in tasks if t.final and (t.exceeded or (not t.stopped and t.state in _FAILED))]
    if failures:
        first = _failure_sentence(failures[0])
        if len(failures) == 1:
            return RunState.FAILED, first
        return RunState.FAILED, R.WorkersFailed(failed=len(failures), total=len(tasks), first=first.text)
    if current in RUN_TERMINAL:
        return None
    if all(t.final for t in tasks):
        if any(t.state is TaskState.CANCELLED or t.stopped for t in tasks):
            return RunState.CANCELLED, R.SomeCancelled()
        return RunState.COMPLETED, R.AllWorkersCompleted()
    running = sum(t.state in (TaskState.RUNNING, TaskState.STALE) for t in tasks)
    if running:
        return RunState.RUNNING, R.WorkersRunning(running=running, total=len(tasks))
    if any(t.state is TaskState.STOPPING for t in tasks):
        return None  # stopping: the run keeps what it showed until its workers are gone
    return RunState.PENDING, _waiting_reason(tasks)
