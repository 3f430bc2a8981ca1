"""A gang's rules: its members wait at a barrier until all are ready, start together, and leave and come back
together (a gang restart, a preemption, a barrier that timed out).

Each function looks at the run after the events of a decision were applied, and moves the members it concerns.
"""

from __future__ import annotations

from datetime import timedelta

from workflows.domain.reasons import R, Reason
from workflows.domain.run.events import ArmTimer, Timer
from workflows.domain.run.lifecycle import TaskEvent
from workflows.domain.run.status import (
    RUN_TERMINAL,
    TASK_ENDED,
    RequeueWithGang,
    TaskRecord,
    TaskState,
)
from workflows.domain.run.step import GANG_REQUEUE_CAUSES, Step, next_attempt

S = TaskState
# At the barrier, or past it.
READY_OR_PAST = frozenset({S.READY_TO_START, S.STARTING, S.RUNNING, S.STALE})
# A member still being set up: the barrier cannot open yet.
SETTING_UP = frozenset({S.PREPARING, S.PULLING})


def _active(step: Step) -> bool:
    job = step.job
    return job.spec.gang and job.state not in RUN_TERMINAL and not job.cancel_requested


def arrived(step: Step, task: TaskRecord) -> None:
    """A member is set up: it waits at the barrier; the first to arrive starts the barrier's timeout."""
    job = step.job
    step.move(task, TaskEvent.READY, R.WaitingAtBarrier())
    if job.barrier_since is None:
        job.barrier_since = step.now
        at = step.now + timedelta(seconds=job.settings.barrier_timeout_seconds)
        step.commands.append(ArmTimer(timer=Timer.BARRIER, task_id="", attempt=job.barrier_round, at=at))


def open_barrier(step: Step) -> None:
    """Every member is ready (with min_available: the minimum, and nobody still setting up): start them all."""
    job = step.job
    if not _active(step):
        return
    waiting = [t for t in job.tasks if t.state is S.READY_TO_START and not t.attempt.released and not t.final]
    if not waiting:
        return
    live = [t for t in job.tasks if not t.final]
    if any(t.state in SETTING_UP or t.placed_pending or t.state is S.STOPPING or t.state in TASK_ENDED for t in live):
        return  # a member is still being set up (or placed, not picked up yet), or the gang is coming apart
    if job.spec.min_available is None and any(t.state is S.PENDING for t in live):
        return
    if sum(t.state in READY_OR_PAST for t in live) < (job.spec.min_available or len(live)):
        return
    for task in waiting:
        task.attempt.released = True
        step.start(task)
    job.barrier_since = None
    job.barrier_round += 1


def barrier_timed_out(step: Step, round: int) -> None:
    """The barrier waited its whole timeout: stop every placed member; the gang queues again once all are gone."""
    job = step.job
    if round != job.barrier_round or job.barrier_since is None or not _active(step):
        return
    job.barrier_since = None
    job.barrier_round += 1
    reason = R.GangBarrierTimedOut()
    for task in job.tasks:
        if not task.final and task.on_node and task.state is not S.STOPPING:
            task.after = RequeueWithGang(reason=reason, at=task.restart_at)
            step.stop_for(task, "barrier", reason)


def preempted(step: Step, by: str) -> None:
    """A gang is preempted whole: a member alone cannot run."""
    reason = R.PreemptedByHigherPriority(run=by)
    for task in step.job.tasks:
        if step.stoppable(task):  # marked only if the preemption stops it
            task.preempted_by = by
            step.stop_for(task, "preempted", reason)


def _waits_for_gang(task: TaskRecord) -> bool:
    """Ended, and queued again only with the whole gang: stopped for the gang, or the member that failed."""
    if task.final or task.state not in TASK_ENDED:
        return False
    if task.state is S.CANCELLED:
        return task.stop is not None and task.stop.cause in GANG_REQUEUE_CAUSES
    return isinstance(task.after, RequeueWithGang)


def requeue_gang(step: Step) -> None:
    """Once no member is on a machine and the failed member's back-off is over, the members that left queue
    again together: one request, so the scheduler places them whole."""
    job = step.job
    if not _active(step) or any(t.on_node for t in job.tasks):
        return
    leaving = [t for t in job.tasks if _waits_for_gang(t)]
    if not leaving or any(t.restart_at is not None and t.restart_at > step.now for t in leaving):
        return
    for task in leaving:
        if task.state is S.CANCELLED:
            step.requeue(task, _requeue_reason(task))
        else:  # the member whose failure restarted the gang: a restart, counted
            assert isinstance(task.after, RequeueWithGang)  # what _waits_for_gang found
            restarts = task.restarts + 1
            step.move(task, TaskEvent.RESTART, task.after.reason)
            next_attempt(task)
            task.restarts = restarts
    step.place(*leaving)


def _requeue_reason(task: TaskRecord) -> Reason:
    """What a member stopped for the gang is queued again with: why it was preempted, else why the gang left."""
    if task.stop is not None and task.stop.cause == "preempted" and task.preempted_by is not None:
        return R.PreemptedQueuedAgain(run=task.preempted_by)
    match task.after:
        case RequeueWithGang(reason=reason):
            return reason
    return R.WaitingForWorkersToStart()
