"""What a run does next: `decide(job, events, now)` returns the new state and the commands to carry out.

The JobWorkflow turns signals, updates, activity results and timers into these events, and carries out the
commands (place, release, start, stop, arm a timer). Nothing here performs an effect.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from workflows.domain.lifecycle import TaskEvent, derive_run, next_state
from workflows.domain.placement import Allocation, TaskRequest
from workflows.domain.reasons import R, Reason
from workflows.domain.restarts import decide_restart, restarted_reason
from workflows.domain.settings import Settings
from workflows.domain.spec import GroupSpec, JobSpec
from workflows.domain.status import (
    RUN_TERMINAL,
    TASK_ENDED,
    TASK_ON_NODE,
    JobRecord,
    LastFailure,
    NodeReasons,
    RunState,
    Status,
    TaskRecord,
    TaskState,
    record,
)


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---- Events ---------------------------------------------------------------------------------------------------


class Created(_Msg):
    kind: Literal["created"] = "created"


class PlacementUpdate(_Msg):
    """The scheduler's answer for one worker: a machine, or why it waits."""

    kind: Literal["placement"] = "placement"
    task_id: str
    attempt: int
    node: str | None = None
    code: str = ""
    reason: str = ""
    nodes: list[NodeReasons] = Field(default_factory=list)


class TaskStarted(_Msg):
    kind: Literal["started"] = "started"
    task_id: str
    attempt: int


class TaskProgress(_Msg):
    """The machine is setting the worker up: a Preparing reason (a wait), or Pulling its image."""

    kind: Literal["progress"] = "progress"
    task_id: str
    attempt: int
    pulling: bool = False
    code: str
    reason: str


class TaskSetupFailed(_Msg):
    kind: Literal["setup_failed"] = "setup_failed"
    task_id: str
    attempt: int
    code: str
    reason: str


class TaskRunning(_Msg):
    kind: Literal["running"] = "running"
    task_id: str
    attempt: int


class TaskEnded(_Msg):
    """The machine saw the worker's process end (or found it gone)."""

    kind: Literal["ended"] = "ended"
    task_id: str
    attempt: int
    exit_code: int | None = None
    oom: bool = False
    not_found: bool = False
    log_tail: str = ""


class CancelRequested(_Msg):
    kind: Literal["cancel"] = "cancel"


class StopRequested(_Msg):
    kind: Literal["stop"] = "stop"
    task_id: str
    reason: str = R.StoppedByScheduler.template


class RestartDue(_Msg):
    kind: Literal["restart_due"] = "restart_due"
    task_id: str
    attempt: int


Event = Annotated[
    Created
    | PlacementUpdate
    | TaskStarted
    | TaskProgress
    | TaskSetupFailed
    | TaskRunning
    | TaskEnded
    | CancelRequested
    | StopRequested
    | RestartDue,
    Field(discriminator="kind"),
]


# ---- Commands -------------------------------------------------------------------------------------------------


class Place(_Msg):
    kind: Literal["place"] = "place"
    requests: list[TaskRequest]


class Release(_Msg):
    """Give back a worker's room (or its place in the queue) at the scheduler."""

    kind: Literal["release"] = "release"
    task_id: str
    attempt: int


class Start(_Msg):
    kind: Literal["start"] = "start"
    task_id: str
    attempt: int
    node: str
    group: GroupSpec


class Stop(_Msg):
    kind: Literal["stop"] = "stop"
    task_id: str
    attempt: int
    node: str


class ArmRestart(_Msg):
    kind: Literal["arm_restart"] = "arm_restart"
    task_id: str
    attempt: int
    at: datetime


Command = Annotated[Place | Release | Start | Stop | ArmRestart, Field(discriminator="kind")]


# ---- Decisions ------------------------------------------------------------------------------------------------


def new_job(spec: JobSpec, settings: Settings, now: datetime) -> JobRecord:
    """A run just accepted: Pending, "Run created"."""
    reason = R.RunCreated()
    job = JobRecord(
        spec=spec,
        settings=settings,
        status=Status(state=RunState.PENDING, reason=reason.text, code=reason.code, created_at=now),
    )
    record(job.status, job.history, RunState.PENDING, reason, now)
    return job


def plan_tasks(spec: JobSpec, now: datetime) -> list[TaskRecord]:
    """One worker per replica of each group, named `<group>-<index>`."""
    reason = R.WaitingForWorkersToStart()
    tasks = []
    for group in spec.groups:
        for index in range(group.replicas):
            status = Status(state=TaskState.PENDING, reason=reason.text, code=reason.code, created_at=now)
            task = TaskRecord(id=f"{group.name}-{index}", group=group.name, index=index, status=status)
            record(task.status, task.history, TaskState.PENDING, reason, now)
            tasks.append(task)
    return tasks


def group_of(job: JobRecord, task: TaskRecord) -> GroupSpec:
    return next(g for g in job.spec.groups if g.name == task.group)


def task_request(job: JobRecord, task: TaskRecord) -> TaskRequest:
    group = group_of(job, task)
    return TaskRequest(
        job_id=job.id,
        namespace=job.spec.namespace,
        task_id=task.id,
        index=job.tasks.index(task),
        attempt=task.attempt,
        priority=job.spec.priority,
        submitted_at=job.status.created_at,
        cpu=group.cpu,
        memory_bytes=group.memory_bytes,
        gpus=group.gpus,
    )


def allocation(job: JobRecord, task: TaskRecord) -> Allocation:
    """What a placed worker holds on its machine."""
    group = group_of(job, task)
    assert task.node is not None
    return Allocation(
        job_id=job.id,
        task_id=task.id,
        attempt=task.attempt,
        node=task.node,
        cpu=group.cpu,
        memory_bytes=group.memory_bytes,
        gpus=group.gpus,
    )


class _Step:
    """One decision in progress: the job being changed and the commands gathered."""

    def __init__(self, job: JobRecord, now: datetime) -> None:
        self.job = job
        self.now = now
        self.commands: list[Command] = []

    def move(self, task: TaskRecord, event: TaskEvent, reason: Reason) -> None:
        state = next_state(task.state, event)
        record(task.status, task.history, state, reason, self.now)

    def end(self, task: TaskRecord, event: TaskEvent, reason: Reason) -> None:
        """The worker's process is gone: record it, give back its room, and apply its restart policy."""
        self.move(task, event, reason)
        self.commands.append(Release(task_id=task.id, attempt=task.attempt))
        task.status.finished_at = self.now
        policy = group_of(self.job, task).restart_policy
        if task.state is TaskState.CANCELLED or self.job.state in RUN_TERMINAL or self.job.cancel_requested:
            task.final = True
            return
        decision = decide_restart(policy, task.state, task.restarts, task.running_since, self.now, self.job.settings)
        task.restarts = decision.restarts
        if decision.restart_at is None:
            task.final = True
            if decision.final_reason:
                record(task.status, task.history, task.state, decision.final_reason, self.now)
            return
        task.restart_at = decision.restart_at
        self.commands.append(ArmRestart(task_id=task.id, attempt=task.attempt, at=decision.restart_at))

    def stop(self, task: TaskRecord, reason: Reason) -> None:
        """Stop a worker: a placed one goes Stopping, a waiting one straight to Cancelled."""
        if task.final:
            return
        task.stopped = True
        if task.state is TaskState.PENDING:
            self.move(task, TaskEvent.STOP, reason)
            task.final = True
            task.status.finished_at = self.now
            self.commands.append(Release(task_id=task.id, attempt=task.attempt))
        elif task.state in TASK_ON_NODE and task.state is not TaskState.STOPPING:
            self.move(task, TaskEvent.STOP, reason)
            assert task.node is not None
            self.commands.append(Stop(task_id=task.id, attempt=task.attempt, node=task.node))
        elif task.state in TASK_ENDED:
            # Waiting out a back-off: it will not start again.
            task.final, task.restart_at = True, None
            record(task.status, task.history, task.state, reason, self.now)


def _current(job: JobRecord, task_id: str, attempt: int) -> TaskRecord | None:
    """The worker an event is about, or None when the event is about an attempt that is over."""
    try:
        task = job.task(task_id)
    except KeyError:
        return None
    return task if task.attempt == attempt else None


def _apply(step: _Step, event: Event) -> None:
    job, now = step.job, step.now
    match event:
        case Created():
            record(job.status, job.history, RunState.PENDING, R.WaitingForWorkersToBeCreated(), now)
            job.tasks = plan_tasks(job.spec, now)
            record(job.status, job.history, RunState.PENDING, R.WaitingForWorkersToStart(), now)
            step.commands.append(Place(requests=[task_request(job, t) for t in job.tasks]))
        case PlacementUpdate(task_id=task_id, attempt=attempt, node=node):
            task = _current(job, task_id, attempt)
            if task is not None and node is not None and task.node == node and task.state in TASK_ON_NODE:
                return  # the same grant again (a retried request): already carried out
            if task is None or task.state is not TaskState.PENDING or task.final:
                if node is not None:  # placed after it stopped waiting: give the room back
                    step.commands.append(Release(task_id=task_id, attempt=attempt))
                return
            if node is None:
                record(task.status, task.history, task.state, Reason(event.code, event.reason), now)
                task.waiting_on = event.nodes
                return
            task.node, task.waiting_on = node, []
            step.move(task, TaskEvent.PLACED, R.Placed(node=node))
            step.commands.append(Start(task_id=task.id, attempt=attempt, node=node, group=group_of(job, task)))
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
            reason = Reason(event.code, event.reason)
            if task.state is TaskState.STOPPING:
                step.end(task, TaskEvent.STOP_CONFIRMED, R.StoppedOnRequest())
                return
            task.last_failure = LastFailure(exit_code=None, reason=reason.text, log_tail="")
            step.end(task, TaskEvent.SETUP_FAILED, reason)
        case TaskRunning(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None and task.state is TaskState.STARTING:
                _running(step, task)
        case TaskEnded():
            _ended(step, event)
        case CancelRequested():
            job.cancel_requested = True
            for task in job.tasks:
                step.stop(task, R.RunCancelled())
        case StopRequested(task_id=task_id):
            step.stop(job.task(task_id), Reason(R.StoppedByScheduler.code, event.reason))
        case RestartDue(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is None or task.final or task.restart_at is None:
                return
            task.restarts += 1
            task.attempt += 1
            task.restart_at = task.node = task.running_since = None
            step.move(task, TaskEvent.RESTART, restarted_reason(task.restarts, job.settings))
            step.commands.append(Place(requests=[task_request(job, task)]))


def _running(step: _Step, task: TaskRecord) -> None:
    """The machine reports the worker running; the run shows it before anything that follows in the batch."""
    step.move(task, TaskEvent.CONTAINER_RUNNING, R.ContainerRunning())
    task.running_since = step.now
    task.status.started_at = task.status.started_at or step.now
    _derive(step)


def _ended(step: _Step, event: TaskEnded) -> None:
    task = _current(step.job, event.task_id, event.attempt)
    if task is None or task.state not in TASK_ON_NODE:
        return
    if task.state is TaskState.STOPPING:
        # A worker Astraeus stops ends Cancelled, whatever its exit code.
        step.end(task, TaskEvent.STOP_CONFIRMED, R.StoppedOnRequest())
        return
    if task.state is TaskState.STARTING:
        # It ran: its end reached us before the machine's "running" report was handled.
        _running(step, task)
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


_RUN_STOP_REASON = {
    RunState.FAILED: R.RunFailed,
    RunState.COMPLETED: R.RunCompleted,
    RunState.CANCELLED: R.RunCancelled,
}


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
        for task in job.tasks:
            step.stop(task, _RUN_STOP_REASON[state]())


def decide(job: JobRecord, events: list[Event], now: datetime) -> tuple[JobRecord, list[Command]]:
    """Apply a batch of events in order, then re-derive the run. Returns a new record and the commands."""
    step = _Step(job.model_copy(deep=True), now)
    for event in events:
        _apply(step, event)
    _derive(step)
    return step.job, step.commands


def is_settled(job: JobRecord) -> bool:
    """The run ended and none of its workers is still on a machine: its workflow may close."""
    return job.state in RUN_TERMINAL and all(t.final for t in job.tasks)
