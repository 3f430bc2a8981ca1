"""What a run does next: `decide(job, events, now)` returns the new state and the commands to carry out.

The JobWorkflow turns signals, updates, activity results and timers into events (workflows/domain/run/events.py), and
carries out the commands (place, release, start, supervise, stop, arm a timer). Nothing here performs an effect.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from workflows.domain.reasons import R, Reason, duration
from workflows.domain.requests import TaskRequest
from workflows.domain.run import gang, groups, machines
from workflows.domain.run.effects import effects
from workflows.domain.run.events import (
    ArmTimer,
    CancelRequested,
    Command,
    Created,
    Event,
    ExitedWhileLost,
    GroupPlanned,
    HeartbeatLate,
    MachineHeard,
    MachineLost,
    Place,
    PlacementUpdate,
    PlanGroup,
    Preempt,
    Release,
    StopConfirmed,
    StopRequested,
    TaskEnded,
    TaskHealth,
    TaskProgress,
    TaskReady,
    TaskRunning,
    TaskSetupFailed,
    TaskStarted,
    Timer,
    TimerFired,
)
from workflows.domain.run.lifecycle import RunShape, TaskEvent, derive_run, failed_for_good
from workflows.domain.run.restarts import restarted_reason
from workflows.domain.run.status import (
    RUN_TERMINAL,
    TASK_ENDED,
    TASK_ON_NODE,
    Final,
    JobRecord,
    LastFailure,
    RequeueWithGang,
    RestartAt,
    RunState,
    StatusEntry,
    TaskRecord,
    TaskState,
    compact,
    record,
)
from workflows.domain.run.step import Step, end_for_good, next_attempt
from workflows.domain.run.tasks import (
    group_of,
    groups_of,
    heartbeat_ttl,
    new_job,
    plan_request,
    plan_tasks,
    split,
    unplanned,
)
from workflows.domain.settings import Settings
from workflows.domain.spec import GroupSpec, JobSpec


def _current(job: JobRecord, task_id: str, attempt: int) -> TaskRecord | None:
    """The worker an event is about, or None when the event is about an attempt that is over."""
    try:
        task = job.task(task_id)
    except KeyError:
        return None
    return task if task.attempt.number == attempt else None


def _running(step: Step, task: TaskRecord) -> None:
    """The machine reports the worker running; the run shows it before anything that follows in the batch."""
    step.move(task, TaskEvent.CONTAINER_RUNNING, R.ContainerRunning())
    task.attempt.running_since = step.now
    task.status.started_at = task.status.started_at or step.now
    if task.restarts > 0 or step.job.protocol < 2:  # a count of 0 has nothing to reset: no timer (and no event)
        step.arm(Timer.RESET, task, step.now + timedelta(seconds=step.job.settings.restart_reset_seconds))
    limit = group_of(step.job, task).time_limit_seconds
    if limit is not None:
        step.arm(Timer.TIME_LIMIT, task, step.now + timedelta(seconds=limit))
    _derive(step)


# An answer without a machine always says why. Should one not, it is recorded as it was when reasons travelled as a
# pair of fields, empty: the same history on replay.
_UNSAID = Reason("", "")


def _placed(step: Step, event: PlacementUpdate) -> None:
    job, now = step.job, step.now
    task = _current(job, event.task_id, event.attempt)
    node = event.node
    if task is not None and node is not None and task.node == node and task.on_node:
        return  # the same grant again (a retried request): already carried out
    if task is None or not task.waiting or task.final:
        if node is not None:  # placed after it stopped waiting: give the room back
            step.commands.append(Release(task_id=event.task_id, attempt=event.attempt))
        return
    if node is None:
        record(task.status, task.history, task.state, event.reason or _UNSAID, now)
        task.waiting_on = event.nodes
        reached = event.quota_reached
        if reached is not None and not job.quota_noted:
            # "Quota reached: <why>": a history entry (and an event) the first time; the status is unchanged.
            job.quota_noted = True
            job.history.append(StatusEntry(state=job.status.state, reason=reached.text, code=reached.code, at=now))
        return
    task.attempt.node, task.attempt.address, task.waiting_on, task.preempted_by = node, event.address, [], None
    if job.protocol >= 5:  # Pending until its machine picks it up (_picked_up)
        record(task.status, task.history, TaskState.PENDING, R.Placed(node=node), now)
    else:
        step.move(task, TaskEvent.PLACED, R.Placed(node=node))
    step.start(task, barrier=job.spec.gang)


def _reported(step: Step, task: TaskRecord, at: datetime | None) -> datetime:
    """When a machine says something happened to the worker: its time, kept after the worker's latest entry and
    not after now (the machine's clock is not the run's), so the history stays in order and true."""
    if at is None:
        return step.now
    return max(task.history[-1].at, min(at, step.now))


def _picked_up(step: Step, task: TaskRecord, at: datetime | None) -> None:
    """A report of its machine about a placed worker shows that the machine picked it up (at `at`, when it says):
    Pending -> Preparing "Picked up by <machine>". Nothing for a worker already picked up, or not placed."""
    if task.placed_pending:
        assert task.node is not None
        step.move(task, TaskEvent.PICKED_UP, R.PickedUp(node=task.node), at=_reported(step, task, at))


def _ended(step: Step, event: TaskEnded) -> None:
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


def _exited_while_lost(step: Step, event: ExitedWhileLost) -> None:
    """The worker was lost with its machine, which came back and read its exit 0 back: it completed, and its restart
    is called off. Only while it waits out its back-off (not yet run again), outside a gang and RestartJob (whose
    other workers were stopped for it), and unless restart_policy Always would run it again anyway."""
    job = step.job
    task = _current(job, event.task_id, event.attempt)
    if task is None or task.state is not TaskState.DOWN or task.final or task.node != event.node:
        return
    lost = task.last_failure is not None and task.last_failure.reason == R.MachineLost().text
    policy = group_of(job, task).restart_policy
    if not lost or step.gang or job.spec.failure_policy == "RestartJob" or policy == "Always":
        return
    if job.cancel_requested or job.state in RUN_TERMINAL:
        return
    step.move(task, TaskEvent.EXITED_ZERO, R.ExitedWithCode(exit_code=0))
    task.after, task.last_failure = Final(), None


def _timer(step: Step, event: TimerFired) -> None:
    job, now = step.job, step.now
    if event.timer is Timer.BARRIER:
        gang.barrier_timed_out(step, event.attempt)
        return
    if event.timer is Timer.REPLAN:
        group = next((g for g in unplanned(job) if g.name == event.task_id), None)
        if group is not None and not job.tasks and job.state not in RUN_TERMINAL and not job.cancel_requested:
            step.commands.append(_plan(job, group))
        return
    task = _current(job, event.task_id, event.attempt)
    if task is None or task.final:
        return
    match event.timer:
        case Timer.RESTART if task.state in TASK_ENDED:
            _back_off_over(step, task)
        case Timer.RESET if task.state in (TaskState.RUNNING, TaskState.STALE):
            since = task.attempt.running_since
            if since is not None and now - since >= timedelta(seconds=job.settings.restart_reset_seconds):
                task.restarts = 0
        case Timer.STALE_TTL if task.state is TaskState.STALE and _stale_for_its_ttl(job, task, now):
            step.end(task, TaskEvent.TTL_EXPIRED, R.NoHeartbeatForTtl())
        case Timer.TIME_LIMIT if task.state in (TaskState.RUNNING, TaskState.STALE):
            # Only while the attempt it was armed for still runs: a timer outlives an attempt that ended (it waits
            # out its back-off as the same attempt), and a worker stopping already ends as its stop says.
            task.exceeded = duration(group_of(job, task).time_limit_seconds or 0)
            step.stop_for(task, "time_limit", R.ExceededTimeLimit(duration=task.exceeded))


def _stale_for_its_ttl(job: JobRecord, task: TaskRecord, now: datetime) -> bool:
    """Stale for its whole TTL since it last went stale: a TTL timer armed when it went stale before (and came back)
    is not about this time."""
    since = task.attempt.stale_since
    return since is not None and now - since >= timedelta(seconds=heartbeat_ttl(job, task))


def _back_off_over(step: Step, task: TaskRecord) -> None:
    """An ended worker's back-off is over: it is queued again, as what follows its end says."""
    match task.after:
        case RequeueWithGang() if step.gang:
            return  # the gang queues again together once every member is gone (gang.requeue_gang)
        case RestartAt():
            again = None
        case RequeueWithGang(reason=reason, at=datetime()):
            again = reason  # queued again with the others, with why (a gang restart)
        case _:
            return
    requeued = [task]
    if task.state is TaskState.CANCELLED:  # a gang restart: queued again, no restart counted
        step.requeue(task, again or R.WaitingForWorkersToStart())
    else:
        restarts = task.restarts + 1
        reason = again or restarted_reason(restarts, step.job.settings)
        step.move(task, TaskEvent.RESTART, reason)
        next_attempt(task)
        task.restarts = restarts
        requeued += _gang_waiting(step, reason)
    step.place(*requeued)


def _gang_waiting(step: Step, reason: Reason) -> list[TaskRecord]:
    """RestartJob: the members stopped for the gang restart are queued again with the failed one, once its back-off
    is over (a restart of another worker by its own policy meanwhile leaves them waiting)."""
    waiting = [
        t
        for t in step.job.tasks
        if t.stop is not None
        and t.stop.cause == "gang_restart"
        and t.state is TaskState.CANCELLED
        and not t.final
        and (t.restart_at is None or t.restart_at <= step.now)
    ]
    for task in waiting:
        match task.after:
            case RequeueWithGang(reason=why):
                step.requeue(task, why)
            case _:
                step.requeue(task, reason)
    return waiting


def _plan(job: JobRecord, group: GroupSpec) -> PlanGroup:
    assert group.total_gpus is not None
    request = plan_request(job, group)
    return PlanGroup(group=group.name, request=request, total_gpus=group.total_gpus, machines=group.machines)


def _create_tasks(step: Step) -> None:
    """Once every group is planned: the workers, asking for machines (those held by depends_on show why not)."""
    job = step.job
    if job.tasks or unplanned(job):
        return
    job.tasks = plan_tasks(groups_of(job), step.now)
    record(job.status, job.history, RunState.PENDING, R.WaitingForWorkersToStart(), step.now)
    step.place(*groups.hold(job, job.tasks))


def _planned(step: Step, event: GroupPlanned) -> None:
    """A group of total_gpus split into workers, or "Cannot plan workers: <why>" and a look again later."""
    job, now = step.job, step.now
    group = next((g for g in unplanned(job) if g.name == event.group), None)
    if group is None or job.tasks or job.state in RUN_TERMINAL or job.cancel_requested:
        return
    if event.workers:
        job.planned[group.name] = split(group, event.workers, event.gpus_per_worker)
        _create_tasks(step)
        return
    record(job.status, job.history, RunState.PENDING, Reason(R.CannotPlanWorkers.code, event.reason), now)
    at = now + timedelta(seconds=job.settings.replan_interval_seconds)
    step.commands.append(ArmTimer(timer=Timer.REPLAN, task_id=group.name, attempt=0, at=at))


def _apply(step: Step, event: Event) -> None:
    job, now = step.job, step.now
    match event:
        case Created():
            record(job.status, job.history, RunState.PENDING, R.WaitingForWorkersToBeCreated(), now)
            for group in unplanned(job):
                step.commands.append(_plan(job, group))
            _create_tasks(step)
        case GroupPlanned():
            _planned(step, event)
        case PlacementUpdate():
            _placed(step, event)
        case TaskStarted(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None:
                _picked_up(step, task, None)
            if task is not None and task.state in (TaskState.PREPARING, TaskState.PULLING):
                step.move(task, TaskEvent.CONTAINER_STARTED, R.ContainerStarted())
            elif task is not None and task.state is TaskState.READY_TO_START and task.attempt.released:
                step.move(task, TaskEvent.BARRIER_RELEASED, R.ContainerStarted())
        case TaskReady(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None:
                _picked_up(step, task, event.picked_up_at)
            if task is not None and task.state in (TaskState.PREPARING, TaskState.PULLING):
                if event.node_address is not None:  # where the others reach it, before it starts (MASTER_ADDR)
                    task.attempt.node_address = event.node_address
                gang.arrived(step, task)
        case StopConfirmed(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None and task.state is TaskState.STOPPING:
                step.end(task, TaskEvent.STOP_CONFIRMED, R.StoppedOnRequest())
        case TaskHealth(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None and task.state in (TaskState.STARTING, TaskState.RUNNING, TaskState.STALE):
                task.attempt.healthy = event.healthy
        case TaskProgress(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None:
                _picked_up(step, task, event.picked_up_at)
            if task is None or task.state not in (TaskState.PREPARING, TaskState.PULLING):
                return
            if event.reason.code == R.PickedUp.code:
                return  # said only to show it Preparing: a worker Preparing already, or further, keeps its reason
            reason = event.reason
            if event.pulling and task.state is TaskState.PREPARING:
                step.move(task, TaskEvent.PULL, reason)
            else:
                record(task.status, task.history, task.state, reason, now)
        case TaskSetupFailed(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None:
                _picked_up(step, task, None)  # it failed being set up: its machine had picked it up
            if task is None or task.state not in TASK_ON_NODE:
                return
            if task.state is TaskState.STOPPING:
                step.end(task, TaskEvent.STOP_CONFIRMED, R.StoppedOnRequest())
                return
            setting_up = task.state in (TaskState.PREPARING, TaskState.PULLING)
            if not setting_up and not (task.state is TaskState.READY_TO_START and task.attempt.released):
                return  # it started after all: a stray failure of an earlier start call
            task.last_failure = LastFailure(exit_code=None, reason=event.reason.text, log_tail="")
            step.end(task, TaskEvent.SETUP_FAILED, event.reason)
        case TaskRunning(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None and event.started:
                _picked_up(step, task, event.picked_up_at)
                if event.external:  # its machine assigned its external ports: describe shows where to reach it
                    task.attempt.external = dict(event.external)
                if event.node_address:  # on the node network: describe shows where the run's workers reach it
                    task.attempt.node_address = event.node_address
            if task is not None and event.started and task.state in (TaskState.PREPARING, TaskState.PULLING):
                at = _reported(step, task, event.started_at)
                step.move(task, TaskEvent.CONTAINER_STARTED, R.ContainerStarted(), at=at)
            elif (
                task is not None and event.started and task.state is TaskState.READY_TO_START and task.attempt.released
            ):
                step.move(task, TaskEvent.BARRIER_RELEASED, R.ContainerStarted())
            if task is not None and task.state is TaskState.STARTING:
                _running(step, task)
            elif task is not None and task.state is TaskState.STALE and event.heartbeat:
                step.move(task, TaskEvent.HEARTBEAT_BACK, R.HeartbeatReceived())
                task.attempt.stale_since = None
        case HeartbeatLate(task_id=task_id, attempt=attempt):
            task = _current(job, task_id, attempt)
            if task is not None and task.state is TaskState.RUNNING:
                step.move(task, TaskEvent.HEARTBEAT_LATE, R.HeartbeatLeaseExpired())
                task.attempt.stale_since = now
                step.arm(Timer.STALE_TTL, task, now + timedelta(seconds=heartbeat_ttl(job, task)))
        case TaskEnded():
            _ended(step, event)
        case ExitedWhileLost():
            _exited_while_lost(step, event)
        case TimerFired():
            _timer(step, event)
        case MachineLost():
            machines.lost(step, event)
        case MachineHeard():
            machines.heard(step, event)
        case CancelRequested() if job.cancel_requested or job.state in RUN_TERMINAL:
            pass  # Temporal's cancellation after `astraeus cancel`, or one that reached a run that just ended
        case CancelRequested(deleting=deleting):
            job.cancel_requested = True
            for task in job.tasks:
                step.stop(task, R.RunDeleted() if deleting else R.RunCancelled())
        case StopRequested(task_id=task_id):
            step.stop(job.task(task_id), Reason(R.StoppedByScheduler.code, event.reason))
        case Preempt(by=by) if step.gang:
            gang.preempted(step, by)
        case Preempt(task_ids=task_ids, by=by):
            for task in job.tasks:
                if task.id in task_ids and step.stoppable(task):  # marked only if the preemption stops it
                    task.preempted_by = by
                    step.stop_for(task, "preempted", R.PreemptedByHigherPriority(run=by))


def _derive(step: Step) -> None:
    """Re-derive the run from its workers; a run that just ended stops what is still active."""
    job, now = step.job, step.now
    derived = derive_run(job.tasks, job.state, job.cancel_requested, RunShape.of(job.spec))
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
    """What the workers still active are stopped with when the run ends: for a run failed by a worker, why that
    worker failed (its time limit, a gang member's budget, else "A worker failed, and the run fails on a failure");
    "Run failed" for a run failed otherwise."""
    if state is RunState.FAILED:
        ended = [t for t in job.tasks if t.final]
        if any(t.exceeded for t in ended):
            return R.GangMemberExceededTimeLimit() if job.spec.gang else R.WorkerExceededTimeLimit()
        if job.spec.gang and any(t.status.code == R.RetryBudgetExhausted.code for t in ended):
            return R.GangMemberExhaustedBudget()
        if any(failed_for_good(t) for t in ended):
            return R.WorkerFailedRunFails()
    return {RunState.FAILED: R.RunFailed, RunState.COMPLETED: R.RunCompleted, RunState.CANCELLED: R.RunCancelled}[
        state
    ]()


def decide(job: JobRecord, events: list[Event], now: datetime) -> tuple[JobRecord, list[Command]]:
    """Apply a batch of events in order, then re-derive the run. Returns a new record and the commands."""
    step = Step(_changeable(job), now)
    for event in events:
        _apply(step, event)
    groups.release_ready_groups(step)
    gang.open_barrier(step)
    gang.requeue_gang(step)
    _derive(step)
    _compact(step.job)
    return step.job, step.commands


def first_requests(spec: JobSpec, settings: Settings, protocol: int, at: datetime) -> list[TaskRequest]:
    """What a new run's first decision (Created, at `at`) asks the scheduler: the control plane asks it when the run
    loads its settings, so that the run's workflow needs no call of its own for it (workflows/job.py)."""
    job = new_job(spec, settings, at)
    job.protocol = protocol
    job, commands = decide(job, [Created()], at)
    carried = effects(job, at) if protocol >= 6 else commands  # protocol 6 carries out what the record needs
    return [request for command in carried if isinstance(command, Place) for request in command.requests]


@dataclass
class FirstPlacement:
    """What load_settings asked the scheduler for a new run's first decision (`first_requests`), with the answers,
    until a Place that asks only that takes them, or what no Place took is given back."""

    requests: dict[tuple[str, int], TaskRequest] = field(default_factory=dict)
    answers: list[PlacementUpdate] = field(default_factory=list)

    @classmethod
    def of(cls, requests: list[TaskRequest], answers: list[PlacementUpdate]) -> FirstPlacement:
        return cls({(r.task_id, r.attempt): r for r in requests}, list(answers))

    def take(self, place: Place) -> list[PlacementUpdate] | None:
        """The answers to `place` when it asks only what was asked, as asked (those requests are then taken); else
        None, and nothing is taken."""
        asked = [(r.task_id, r.attempt) for r in place.requests]
        if not asked or any(self.requests.get(key) != r for key, r in zip(asked, place.requests, strict=True)):
            return None
        for key in asked:
            del self.requests[key]
        return [a for a in self.answers if (a.task_id, a.attempt) in asked]

    def unasked(self) -> list[Release]:
        """A release of each request no Place took (the first decision asked otherwise: a cancellation came
        first); nothing is left to take afterwards."""
        left, self.requests, self.answers = list(self.requests.values()), {}, []
        return [Release(task_id=r.task_id, attempt=r.attempt) for r in left]


def _changeable(job: JobRecord) -> JobRecord:
    """A deep copy of the record for a decision to change. Its spec and settings are frozen and never changed: the
    copy shares them (copying them was half of every decision's copy)."""
    return copy.deepcopy(job, {id(job.spec): job.spec, id(job.settings): job.settings})


def _compact(job: JobRecord) -> None:
    """Keep each history within `history_keep` entries. Since protocol 4 the entries folded stay in `job.folded`
    until continue-as-new passes them on (the workflow continues as new before it holds `history_keep` of one)."""
    keep, spill = job.settings.history_keep, job.protocol >= 4
    job.summarised, folded = compact(job.history, job.summarised, keep)
    if spill:
        job.folded.run += folded
    for task in job.tasks:
        task.summarised, folded = compact(task.history, task.summarised, keep)
        if spill and folded:
            job.folded.tasks.setdefault(task.id, []).extend(folded)


def is_settled(job: JobRecord) -> bool:
    """The run ended and none of its workers is still on a machine: its workflow may close."""
    return job.state in RUN_TERMINAL and all(t.final for t in job.tasks)


def fail_undecided(job: JobRecord, error: str, now: datetime) -> tuple[JobRecord, list[Command]]:
    """A run whose events `decide` could not decide (it raised `error`): the run fails ("Cannot be decided: <error>")
    and stops every worker ("Run failed"), so that a bug of the core ends one run instead of wedging its workflow;
    the events are dropped. A run that had already ended keeps its state, and its workers still stopping count as
    final: their stops are in flight, and the reports of their ends might not be decidable either."""
    step = Step(_changeable(job), now)
    failed = step.job
    ended_before = failed.state in RUN_TERMINAL
    if not ended_before:
        record(failed.status, failed.history, RunState.FAILED, R.CannotBeDecided(error=error), now)
        failed.status.finished_at = now
    for task in failed.tasks:
        step.stop(task, R.RunFailed())
        if ended_before and task.state is TaskState.STOPPING:
            end_for_good(task)
    return failed, step.commands
