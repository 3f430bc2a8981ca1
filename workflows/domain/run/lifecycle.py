"""The worker state machine as one table, and the run state derived from its workers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from workflows.domain.reasons import R, Reason
from workflows.domain.run.status import (
    RUN_TERMINAL,
    TASK_ENDED,
    TASK_ON_NODE,
    RequeueWithGang,
    RunState,
    TaskRecord,
    TaskState,
)
from workflows.domain.spec import JobSpec


class TaskEvent(StrEnum):
    """What can happen to a worker. Each (state, event) pair in TRANSITIONS is one edge of the spec."""

    PLACED = "Placed"
    PICKED_UP = "PickedUp"
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
    # Placed, and its machine picks it up: it sets it up (credentials, drives, network, identity). Since protocol 5
    # a placed worker stays Pending until its machine says it picked it up.
    (S.PENDING, E.PICKED_UP): S.PREPARING,
    # Protocol 4 and earlier: placed and picked up were one step (the run went on as soon as it was placed).
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
    # Lost with its machine, which came back and says it had exited 0 meanwhile, before it was restarted: it
    # completed, and is not run again (an Astraeus addition to the spec's diagram).
    (S.DOWN, E.EXITED_ZERO): S.COMPLETED,
    # The image, the config or the container start failed while setting up.
    (S.PREPARING, E.SETUP_FAILED): S.FAILED,
    # The pull failed.
    (S.PULLING, E.SETUP_FAILED): S.FAILED,
    # A gang member's container start failed once the barrier opened (its start errors come after ReadyToStart;
    # the spec's "Preparing --> Failed: start errors" for a worker started without a barrier).
    (S.READY_TO_START, E.SETUP_FAILED): S.FAILED,
    # Stopped before its machine picked it up (placed or not): straight to Cancelled.
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


def failed_for_good(task: TaskRecord) -> bool:
    """Failed (or lost) and not to be restarted, rather than stopped by a person, the API or the run."""
    return task.final and not task.stopped and task.state in _FAILED


def _failure_sentence(task: TaskRecord) -> Reason:
    """The run's reason for one worker that failed for good."""
    if task.exceeded is not None:
        return R.WorkerTimeLimit(task=task.id, duration=task.exceeded)
    cause = task.status.reason  # its final reason: the exit, or "Retry budget exhausted after 10/10 restarts"
    if task.node is None:
        return R.WorkerFailedNowhere(task=task.id, reason=cause)
    if task.state is TaskState.DOWN:
        return R.WorkerLost(task=task.id, node=task.node, reason=cause)
    return R.WorkerFailed(task=task.id, node=task.node, reason=cause)


def _waiting_reason(tasks: Sequence[TaskRecord]) -> Reason:
    """A run that runs nothing shows why its first waiting worker waits (a preempted one: why it was)."""
    for task in tasks:
        if task.preempted_by is not None and task.state is TaskState.PENDING:
            cause = R.PreemptedByHigherPriority(run=task.preempted_by).text
            return R.PreemptedWaiting(cause=cause)
    for task in tasks:
        match task.after:
            case RequeueWithGang(reason=reason) if task.state is TaskState.STOPPING or task.state in TASK_ENDED:
                return reason  # stopped (or failed) and queued again with others once they are gone (a gang restart)
    for first in (True, False):  # one that waits for room first, else one placed and on its way
        for task in tasks:
            if task.final or task.state in (TaskState.RUNNING, TaskState.STALE, TaskState.STOPPING):
                continue
            if task.waiting or not first:
                return Reason(task.status.code, task.status.reason)
    return R.WaitingForWorkersToStart()


@dataclass(frozen=True)
class RunShape:
    """What of the spec changes how a run is derived from its workers."""

    gang: bool = False
    min_available: int | None = None
    complete_with: str | None = None
    service: bool = False
    checked: frozenset[str] = frozenset()  # groups with a readiness check: a worker serves once healthy

    @classmethod
    def of(cls, spec: JobSpec) -> RunShape:
        return cls(
            gang=spec.gang,
            min_available=spec.min_available,
            complete_with=spec.complete_with,
            service=spec.lifetime == "Service",
            checked=frozenset(g.name for g in spec.groups if g.readiness is not None),
        )


PLAIN = RunShape()
_RUNNING = (TaskState.RUNNING, TaskState.STALE)
_READY_OR_PAST = (TaskState.READY_TO_START, TaskState.STARTING, *_RUNNING)


def _failed(tasks: Sequence[TaskRecord], shape: RunShape) -> Reason | None:
    """The run's reason when workers failed for good: the worker, or how many and the first; a gang member's
    failure fails the gang, and a serving group's failure the group a complete_with run waits for."""
    failures = [t for t in tasks if (t.final and t.exceeded) or failed_for_good(t)]
    if not failures:
        return None
    first = _failure_sentence(failures[0])
    if len(failures) > 1:
        first = R.WorkersFailed(failed=len(failures), total=len(tasks), first=first.text)
    if shape.gang:
        return R.GangMemberFailed(failure=first.text)
    if shape.complete_with is not None and failures[0].group != shape.complete_with:
        return R.GroupCannotFinish(failure=first.text, group=shape.complete_with)
    return first


def derive_run(
    tasks: Sequence[TaskRecord], current: RunState, cancel_requested: bool = False, shape: RunShape = PLAIN
) -> tuple[RunState, Reason] | None:
    """The run's state and reason from its workers', or None to keep what it shows now.

    Failed as soon as one worker failed for good; Completed or Cancelled once every worker ended for good (or,
    with complete_with, once that group completed); Running while any worker runs (a gang: every member);
    a gang whose members are all placed is Starting; otherwise Pending with its first waiting worker's reason.
    A run cancelled on request ends Cancelled once its workers are gone.
    """
    if not tasks:  # not created yet (its groups are being planned): only a cancel ends it
        return (RunState.CANCELLED, R.SomeCancelled()) if cancel_requested and current not in RUN_TERMINAL else None
    if cancel_requested and current not in RUN_TERMINAL:
        return (RunState.CANCELLED, R.SomeCancelled()) if all(t.final for t in tasks) else None
    if current in (RunState.COMPLETED, RunState.CANCELLED):
        return None
    failed = _failed(tasks, shape)
    if failed is not None:
        return RunState.FAILED, failed
    if current in RUN_TERMINAL:
        return None
    if shape.complete_with is not None:
        group = [t for t in tasks if t.group == shape.complete_with]
        if all(t.final and t.state is TaskState.COMPLETED and not t.stopped for t in group):
            return RunState.COMPLETED, R.GroupCompleted(group=shape.complete_with)
    if all(t.final for t in tasks):
        if any(t.state is TaskState.CANCELLED or t.stopped for t in tasks):
            return RunState.CANCELLED, R.SomeCancelled()
        return RunState.COMPLETED, R.AllWorkersCompleted()
    if shape.gang:
        return _derive_gang(tasks, current, shape)
    running = [t for t in tasks if t.state in _RUNNING]
    if running:
        return RunState.RUNNING, _running_reason(running, len(tasks), shape)
    if any(t.state is TaskState.STOPPING for t in tasks):
        return None  # stopping: the run keeps what it showed until its workers are gone
    return RunState.PENDING, _waiting_reason(tasks)


def _running_reason(running: list[TaskRecord], total: int, shape: RunShape) -> Reason:
    if shape.service:
        serving = sum(t.group not in shape.checked or t.attempt.healthy is True for t in running)
        return R.WorkersServing(running=serving, total=total)
    return R.WorkersRunning(running=len(running), total=total)


def _derive_gang(tasks: Sequence[TaskRecord], current: RunState, shape: RunShape) -> tuple[RunState, Reason] | None:
    """A gang runs when every member runs (with min_available: that many); it is Starting while all its members
    are placed and on their way, and Pending otherwise. It goes back to Pending, never from Running to Starting."""
    live = [t for t in tasks if not t.final]
    needed = shape.min_available or len(live)
    running = [t for t in live if t.state in _RUNNING]
    if len(running) >= needed:
        return RunState.RUNNING, _running_reason(running, len(tasks), shape)
    if any(t.state is TaskState.STOPPING for t in tasks):
        return None  # members are leaving: the run keeps what it showed until they are gone
    placed = [t for t in live if t.on_node]
    if current is not RunState.RUNNING and placed and len(placed) >= needed:
        ready = sum(t.state in _READY_OR_PAST for t in placed)
        total = len(placed) if shape.min_available else len(live)
        return RunState.STARTING, R.StartingTogether(ready=ready, total=total)
    return RunState.PENDING, _waiting_reason(tasks)
