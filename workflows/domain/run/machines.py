"""What a run does when a machine of its workers is late, lost or removed (the liveness its machine's lease carries:
workflows/domain/machine/liveness.py), and when a copy of a worker lost there may still run (its fence:
workflows/domain/machine/fence.py)."""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.domain.machine.fence import fenced_after_late
from workflows.domain.reasons import R
from workflows.domain.run.events import MachineHeard, MachineLost, Release, Timer
from workflows.domain.run.lifecycle import TaskEvent
from workflows.domain.run.status import LastFailure, TaskRecord, TaskState, record
from workflows.domain.run.step import Step, next_attempt
from workflows.domain.run.tasks import heartbeat_ttl

_SETTING_UP = frozenset({TaskState.PENDING, TaskState.PREPARING, TaskState.PULLING, TaskState.READY_TO_START})


def _started_at(task: TaskRecord) -> datetime | None:
    """When the run heard that the worker's current attempt was started (its latest Starting entry since it was last
    set up), or None if it has not been. A history folded past that entry falls back to when it went Running."""
    for entry in reversed(task.history):
        if entry.code == R.HistorySummarised.code:
            break
        if entry.state == TaskState.STARTING:
            return entry.at
        if entry.state in _SETTING_UP:
            return None
    return task.attempt.running_since


def lost(step: Step, event: MachineLost) -> None:
    for task in step.job.tasks:
        if task.node != event.node or not task.on_node:
            continue
        if task.placed_pending:
            # Never picked up, so never lost: it waits for room again, as a new attempt (its machine, should it
            # come back, is refused the old one), no restart counted.
            gone = R.MachineRemoved() if event.removed else R.MachineLost()
            step.commands.append(Release(task_id=task.id, attempt=task.attempt.number))
            record(task.status, task.history, TaskState.PENDING, gone, step.now)
            next_attempt(task)
            step.place(task)
            continue
        started = _started_at(task)
        if event.lost_at is not None and started is not None and started >= event.lost_at:
            continue  # a late report of an earlier loss: a new agent of the machine started this attempt since
        if task.state is TaskState.STOPPING:
            gone = R.MachineRemovedWhileStopping() if event.removed else R.MachineLostWhileStopping()
        else:
            gone = R.MachineRemoved() if event.removed else R.MachineLost()
        lost = TaskEvent.MACHINE_REMOVED if event.removed else TaskEvent.MACHINE_LOST
        if task.state is not TaskState.STOPPING:
            task.last_failure = LastFailure(exit_code=None, reason=gone.text, log_tail="")
        task.attempt.fenced_until = event.fenced_at
        step.end(task, lost, gone)


def heard(step: Step, event: MachineHeard) -> None:
    """Its machine's lease, which carries its workers' liveness (workflows/domain/machine/liveness.py), is late: its
    running workers there are Stale, Down after their TTL unless it is heard again (and restarted elsewhere only once
    their copies surely stopped there); or it is heard again: they run on. Runs from before protocol 7 watch each
    worker with a heartbeat of its own, which says this."""
    if step.job.protocol < 7:
        return
    for task in step.job.tasks:
        if task.node != event.node:
            continue
        if event.late and task.state is TaskState.RUNNING:
            step.move(task, TaskEvent.HEARTBEAT_LATE, R.HeartbeatLeaseExpired())
            task.attempt.stale_since = step.now
            task.attempt.fenced_until = fenced_after_late(event.at, step.job.settings)
            step.arm(Timer.STALE_TTL, task, step.now + timedelta(seconds=heartbeat_ttl(step.job, task)))
        elif not event.late and task.state is TaskState.STALE:
            step.move(task, TaskEvent.HEARTBEAT_BACK, R.HeartbeatReceived())
            task.attempt.stale_since = None
            task.attempt.fenced_until = None
