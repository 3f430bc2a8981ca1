"""What a run does next: `decide(job, events, now)` returns the new state and the commands to carry out.

The JobWorkflow turns signals, updates, activity results and timers into events (workflows/domain/events.py), and
carries out the commands (place, release, start, supervise, stop, arm a timer). Nothing here performs an effect.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.domain.events import (
    ArmTimer,
    CancelRequested,
    Command,
    Created,
    Event,
    HeartbeatLate,
    MachineLost,
    Place,
    PlacementUpdate,
    Preempt,
    Release,
    Start,
    Stop,
    StopRequested,
    TaskEnded,
    TaskProgress,
    TaskRunning,
    TaskSetupFailed,
    TaskStarted,
    Timer,
    TimerFired,
)
from workflows.domain.lifecycle import TaskEvent, derive_run, next_state
from workflows.domain.reasons import R, Reason, duration
from workflows.domain.restarts import decide_restart, restarted_reason
from workflows.domain.status import (
    RUN_TERMINAL,
    TASK_ENDED,
    TASK_ON_NODE,
    JobRecord,
    LastFailure,
    RunState,
    StopCause,
    TaskRecord,
    TaskState,
    compact,
    record,
)
from workflows.domain.tasks import group_of, heartbeat_ttl, plan_tasks, task_request

# ---- One decision -----------------------------------------------------------------------------------------------


class _Step:
    """One decision in progress: the job being changed and the commands gathered."""

    def __init__(self, job: JobRecord, now: datetime) -> None:
        self.job = job
        self.now = now
        self.commands: list[Command] = []

    def move(self, task: TaskRecord, event: TaskEvent, reason: Reason) -> None:
        state = next_state(task.state, event)
        record(task.status, task.history, state, reason, self.now)

    def arm(self, timer: Timer, task: TaskRecord, at: datetime) -> None:
        self.commands.append(ArmTimer(timer=timer, task_id=task.id, attempt=task.attempt, at=at))

    def place(self, *tasks: TaskRecord) -> None:
        self.commands.append(Place(requests=[task_request(self.job, t) for t in tasks]))

    def end(self, task: TaskRecord, event: TaskEvent, reason: Reason) -> None:
        """The worker's process is gone: record it, give back its room, and decide whether it starts again."""
        self.move(task, event, reason)
        self.commands.append(Release(task_id=task.id, attempt=task.attempt))
        task.status.finished_at = self.now
        task.stale_since = None
        if self.job.state in RUN_TERMINAL or self.job.cancel_requested:
            task.final = True
        elif task.state is TaskState.CANCELLED:
            self._after_stop(task)
        else:
            self._restart_policy(task)

    def _after_stop(self, task: TaskRecord) -> None:
        """A stopped worker is gone: a preempted one queues again, a gang restart waits, the rest are final."""
        if task.stop_cause == "preempted" and task.preempted_by is not None:
            self.requeue(task, R.PreemptedQueuedAgain(run=task.preempted_by))
            self.place(task)
        elif task.stop_cause == "gang_restart" and task.restart_at is not None:
            if self.now >= task.restart_at:  # the failed worker's back-off is over already
                self.requeue(task, task.requeue or R.WaitingForWorkersToStart())
                self.place(task)
            # else the failed worker's restart timer queues it again, with every other member
        else:
            task.final = True

    def _restart_policy(self, task: TaskRecord) -> None:
        policy = group_of(self.job, task).restart_policy
        settings = self.job.settings
        decision = decide_restart(policy, task.state, task.restarts, task.running_since, self.now, settings)
        task.restarts = decision.restarts
        if decision.restart_at is None:
            task.final = True
            if decision.final_reason:
                record(task.status, task.history, task.state, decision.final_reason, self.now)
            return
        task.restart_at = decision.restart_at
        self.arm(Timer.RESTART, task, decision.restart_at)
        if self.job.spec.on_failure == "RestartJob" and task.state is not TaskState.COMPLETED:
            self._gang_restart(task, decision.restart_at)

    def _gang_restart(self, failed: TaskRecord, at: datetime) -> None:
        """RestartJob: every worker is queued again with the failed one."""
        reason = R.GangRestart(task=failed.id)
        failed.requeue = reason
        for task in self.job.tasks:
            if task is failed or task.final:
                continue
            task.requeue = reason
            if task.state in TASK_ON_NODE and task.state is not TaskState.STOPPING:
                task.stop_cause, task.restart_at = "gang_restart", at
                self.move(task, TaskEvent.STOP, reason)
                self.commands.append(Stop(task_id=task.id, attempt=task.attempt, node=_node(task)))

    def requeue(self, task: TaskRecord, reason: Reason) -> None:
        """A stopped worker waits for a machine again, as a new attempt, its restart budget untouched."""
        self.move(task, TaskEvent.REQUEUE, reason)
        _next_attempt(task)

    def stop(self, task: TaskRecord, reason: Reason) -> None:
        """Stop a worker: a placed one goes Stopping, a waiting one straight to Cancelled."""
        if task.final:
            return
        task.stopped = True
        task.stop_cause = None
        if task.state is TaskState.PENDING:
            self.move(task, TaskEvent.STOP, reason)
            task.final = True
            task.status.finished_at = self.now
            self.commands.append(Release(task_id=task.id, attempt=task.attempt))
        elif task.state in TASK_ON_NODE and task.state is not TaskState.STOPPING:
            self.move(task, TaskEvent.STOP, reason)
            self.commands.append(Stop(task_id=task.id, attempt=task.attempt, node=_node(task)))
        elif task.state in TASK_ON_NODE:
            pass  # already stopping: it ends Cancelled, and being stopped it stays final
        else:
            # Ended, waiting out a back-off: it will not start again.
            task.final, task.restart_at = True, None
            record(task.status, task.history, task.state, reason, self.now)

    def stop_for(self, task: TaskRecord, cause: StopCause, reason: Reason) -> None:
        """A stop whose cause decides what follows (preemption, time limit): only a worker on a machine."""
        if task.final or task.state not in TASK_ON_NODE or task.state is TaskState.STOPPING:
            return
        self.move(task, TaskEvent.STOP, reason)
        task.stop_cause = cause
        task.stopped = cause == "time_limit"
        self.commands.append(Stop(task_id=task.id, attempt=task.attempt, node=_node(task)))


def _node(task: TaskRecord) -> str:
    assert task.node is not None
    return task.node


def _next_attempt(task: TaskRecord) -> None:
    task.attempt += 1
    task.restart_at = task.node = task.running_since = task.stale_since = None
    task.stop_cause, task.requeue, task.final, task.stopped = None, None, False, False


def _current(job: JobRecord, task_id: str, attempt: int) -> TaskRecord | None:
    """The worker an event is about, or None when the event is about an attempt that is over."""
    try:
        task = job.task(task_id)
    except KeyError:
        return None
    return task if task.attempt == attempt else None


def _running(step: _Step, task: TaskRecord) -> None:
    """The machine reports the worker running; the run shows it before anything that follows in the batch."""
    step.move(task, TaskEvent.CONTAINER_RUNNING, R.ContainerRunning())
    task.running_since = step.now
    task.status.started_at = task.status.started_at or step.now
    step.arm(Timer.RESET, task, step.now + timedelta(seconds=step.job.settings.restart_reset_seconds))
    limit = group_of(step.job, task).time_limit_seconds
    if limit is not None:
        step.arm(Timer.TIME_LIMIT, task, step.now + timedelta(seconds=limit))
    _derive(step)


def _placed(step: _Step, event: PlacementUpdate) -> None:
    job, now = step.job, step.now
    task = _current(job, event.task_id, event.attempt)
    node = event.node
    if task is not None and node is not None and task.node == node and task.state in TASK_ON_NODE:
        return  # the same grant again (a retried request): already carried out
    if task is None or task.state is not TaskState.PENDING or task.final:
        if node is not None:  # placed after it stopped waiting: give the room back
            step.commands.append(Release(task_id=event.task_id, attempt=event.attempt))
        return
    if node is None:
        record(task.status, task.history, task.state, Reason(event.code, event.reason), now)
        task.waiting_on = event.nodes
        return
    task.node, task.waiting_on, task.preempted_by = node, [], None
    step.move(task, TaskEvent.PLACED, R.Placed(node=node))
    step.commands.append(Start(task_id=task.id, attempt=task.attempt, node=node, group=group_of(job, task)))


def _ended(step: _Step, event: TaskEnded) -> None:
    task = _current(step.job, event.task_id, event.attempt)
    if task is None or task.state not in TASK_ON_NODE:
        return
    if task.state is TaskState.STOPPING:
        # A worker Astraeus stops ends Cancelled, whatever its exit code.
        step.end(task, TaskEvent.STOP_CONFIRMED, R.StoppedOnRequest())
        return
    if task.state in (TaskState.PREPARING, TaskState.PULLING, TaskState.READY_TO_START):
        return  # not started yet: a stray report from an earlier supervisor
    if task.state is TaskState.STARTING:
        # It ran: its end reached us before the machine's "running" report was handled.
        _running(step, task)
    if task.state is TaskState.STALE:
        step.move(task, TaskEvent.HEARTBEAT_BACK, R.HeartbeatReceived())
    if event.not_found:
        reason = R.ContainerNotFound()
    elif event.oom:
        reason = R.OOMKilled()
    else:
        reason = R.ExitedWithCode(exit_code=event.exit_code)
    if event.exit_code == 0 and not event.oom and not event.not_found:
        step.end(task, TaskEvent.EXITED_ZERO, reason)
        return
    task.last_failure = LastFailure(exit_code=event.exit_code, reason=reason.text, log_tail=event.log_tail)
    step.end(task, TaskEvent.EXITED_NONZERO, reason)


def _timer(step: _Step, event: TimerFired) -> None:
    job, now = step.job, step.now
    task = _current(job, event.task_id, event.attempt)
    if task is None or task.final:
        return
    match event.timer:
        case Timer.RESTART if task.restart_at is not None and task.state in TASK_ENDED:
            requeued = [task]
            if task.state is TaskState.CANCELLED:  # a gang restart: queued again, no restart counted
                step.requeue(task, task.requeue or R.WaitingForWorkersToStart())
            else:
                reason = task.requeue or restarted_reason(task.restarts + 1, job.settings)
                restarts = task.restarts + 1
                step.move(task, TaskEvent.RESTART, reason)
                _next_attempt(task)
                task.restarts = restarts
                requeued += _gang_waiting(step, reason)
            step.place(*requeued)
        case Timer.RESET if task.state in (TaskState.RUNNING, TaskState.STALE) and task.running_since is not None:
            if now - task.running_since >= timedelta(seconds=job.settings.restart_reset_seconds):
                task.restarts = 0
        case Timer.STALE_TTL if task.state is TaskState.STALE:
            step.end(task, TaskEvent.TTL_EXPIRED, R.NoHeartbeatForTtl())
        case Timer.TIME_LIMIT:
            task.exceeded = duration(group_of(job, task).time_limit_seconds or 0)
            step.stop_for(task, "time_limit", R.ExceededTimeLimit(duration=task.exceeded))


def _gang_waiting(step: _Step, reason: Reason) -> list[TaskRecord]:
    """RestartJob: the members stopped for the gang restart are queued again with the failed one."""
    waiting = [
        t for t in step.job.tasks if t.stop_cause == "gang_restart" and t.state is TaskState.CANCELLED and not t.final
    ]
    for task in waiting:
        step.requeue(task, task.requeue or reason)
    return waiting


def _machine_lost(step: _Step, event: MachineLost) -> None:
    for task in step.job.tasks:
        if task.node != event.node or task.state not in TASK_ON_NODE:
            continue
        if task.state is TaskState.STOPPING:
            gone = R.MachineRemovedWhileStopping() if event.removed else R.MachineLostWhileStopping()
        else:
            gone = R.MachineRemoved() if event.removed else R.MachineLost()
        lost = TaskEvent.MACHINE_REMOVED if event.removed else TaskEvent.MACHINE_LOST
        if task.state is not TaskState.STOPPING:
            task.last_failure = LastFailure(exit_code=None, reason=gone.text, log_tail="")
        step.end(task, lost, gone)


def _apply(step: _Step, event: Event) -> None:
    job, now = step.job, step.now
    match event:
        case Created():
            record(job.status, job.history, RunState.PENDING, R.WaitingForWorkersToBeCreated(), now)
            job.tasks = plan_tasks(job.spec, now)
            record(job.status, job.history, RunState.PENDING, R.WaitingForWorkersToStart(), now)
            step.place(*job.tasks)
        case PlacementUpdate():
            _placed(step, event)
        case TaskStarted(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None and task.state in (TaskState.PREPARING, TaskState.PULLING):
                step.move(task, TaskEvent.CONTAINER_STARTED, R.ContainerStarted())
        case TaskProgress(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is None or task.state not in (TaskState.PREPARING, TaskState.PULLING):
                return
            reason = Reason(event.code, event.reason)
            if event.pulling and task.state is TaskState.PREPARING:
                step.move(task, TaskEvent.PULL, reason)
            else:
                record(task.status, task.history, task.state, reason, now)
        case TaskSetupFailed(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is None or task.state not in TASK_ON_NODE:
                return
            if task.state is TaskState.STOPPING:
                step.end(task, TaskEvent.STOP_CONFIRMED, R.StoppedOnRequest())
                return
            if task.state not in (TaskState.PREPARING, TaskState.PULLING):
                return  # it started after all: a stray failure of an earlier start call
            reason = Reason(event.code, event.reason)
            task.last_failure = LastFailure(exit_code=None, reason=reason.text, log_tail="")
            step.end(task, TaskEvent.SETUP_FAILED, reason)
        case TaskRunning(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None and task.state is TaskState.STARTING:
                _running(step, task)
            elif task is not None and task.state is TaskState.STALE and event.heartbeat:
                step.move(task, TaskEvent.HEARTBEAT_BACK, R.HeartbeatReceived())
                task.stale_since = None
        case HeartbeatLate(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None and task.state is TaskState.RUNNING:
                step.move(task, TaskEvent.HEARTBEAT_LATE, R.HeartbeatLeaseExpired())
                task.stale_since = now
                step.arm(Timer.STALE_TTL, task, now + timedelta(seconds=heartbeat_ttl(job, task)))
        case TaskEnded():
            _ended(step, event)
        case TimerFired():
            _timer(step, event)
        case MachineLost():
            _machine_lost(step, event)
        case CancelRequested():
            job.cancel_requested = True
            for task in job.tasks:
                step.stop(task, R.RunCancelled())
        case StopRequested(task_id=task_id):
            step.stop(job.task(task_id), Reason(R.StoppedByScheduler.code, event.reason))
        case Preempt(task_ids=task_ids, by=by):
            for task in job.tasks:
                if task.id in task_ids:
                    task.preempted_by = by
                    step.stop_for(task, "preempted", R.PreemptedByHigherPriority(run=by))


def _derive(step: _Step) -> None:
    """Re-derive the run from its workers; a run that just ended stops what is still active."""
    job, now = step.job, step.now
    derived = derive_run(job.tasks, job.state, job.cancel_requested)
    if derived is None:
        return
    was_terminal = job.state in RUN_TERMINAL
    state, reason = derived
    record(job.status, job.history, state, reason, now)
    if state is RunState.RUNNING:
        job.status.started_at = job.status.started_at or now
    if state in RUN_TERMINAL and not was_terminal:
        job.status.finished_at = now
        stop_reason = _run_stop_reason(job, state)
        for task in job.tasks:
            step.stop(task, stop_reason)


def _run_stop_reason(job: JobRecord, state: RunState) -> Reason:
    if state is RunState.FAILED and any(t.exceeded and t.final for t in job.tasks):
        return R.WorkerExceededTimeLimit()
    return {RunState.FAILED: R.RunFailed, RunState.COMPLETED: R.RunCompleted, RunState.CANCELLED: R.RunCancelled}[
        state
    ]()


def decide(job: JobRecord, events: list[Event], now: datetime) -> tuple[JobRecord, list[Command]]:
    """Apply a batch of events in order, then re-derive the run. Returns a new record and the commands."""
    step = _Step(job.model_copy(deep=True), now)
    for event in events:
        _apply(step, event)
    _derive(step)
    keep = step.job.settings.history_keep
    step.job.summarised = compact(step.job.history, step.job.summarised, keep)
    for task in step.job.tasks:
        task.summarised = compact(task.history, task.summarised, keep)
    return step.job, step.commands


def is_settled(job: JobRecord) -> bool:
    """The run ended and none of its workers is still on a machine: its workflow may close."""
    return job.state in RUN_TERMINAL and all(t.final for t in job.tasks)
