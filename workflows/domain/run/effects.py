"""What a run's record needs in flight right now: `effects(job, now)`, the commands and timers its state implies,
each with an identity (`identity`), so that two computations can be compared.

The JobWorkflow carries out the commands `decide` returns as each decision is made: what the record after it needs
and was not in flight before is among them (tests/domain/test_effects.py checks it over random runs), besides what
follows a transition once (a release, the stop of a worker placed but not picked up yet) and what a later event of
the same decision made moot. A run that continues as new has nothing in flight: its new workflow run carries out
the effects of the record it is given, the difference from nothing: it asks for room again, arms the timers again,
re-attaches to the workers on machines (never starting one twice) and repeats the stops in progress.

Since protocol 6 a running workflow does the same after each decision: it keeps what it set in flight by identity,
starts the difference (`difference`), cancels the timers no longer needed, and carries out of `decide`'s commands
only those done once (`one_offs`), which no record needs in flight.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from workflows.domain.run.events import ArmTimer, Command, Place, PlanGroup, Release, Start, Stop, Supervise, Timer
from workflows.domain.run.status import JobRecord, TaskRecord, TaskState
from workflows.domain.run.tasks import group_of, heartbeat_ttl, plan_request, task_env, task_request, unplanned


@dataclass(frozen=True, order=True)
class Effect:
    """The identity of a command: two commands of one identity do the same thing, so one in flight is enough."""

    kind: str  # plan, place, setup (a gang member's, up to the barrier), run (start and watch), stop, release, timer
    task: str  # the worker; the group for plan and a replan timer; "" for the barrier's timer
    attempt: int  # the worker's attempt; the barrier's round for its timer
    timer: str = ""  # a timer's kind (events.Timer)


def identity(command: Command) -> list[Effect]:
    """The identities of what `command` sets in flight (a Place: one per worker it asks room for)."""
    match command:
        case Place(requests=requests):
            return [Effect("place", r.task_id, r.attempt) for r in requests]
        case PlanGroup(group=group):
            return [Effect("plan", group, 0)]
        case Start(barrier=True):
            return [Effect("setup", command.task_id, command.attempt)]
        case Start() | Supervise():
            # One activity starts and watches the worker (run_task), or re-attaches to it (supervise_task): the
            # workflow keeps one supervisor per attempt (JobWorkflow._supervisors).
            return [Effect("run", command.task_id, command.attempt)]
        case Stop():
            return [Effect("stop", command.task_id, command.attempt)]
        case Release():
            return [Effect("release", command.task_id, command.attempt)]
        case ArmTimer():
            return [Effect("timer", command.task_id, command.attempt, command.timer.value)]
    raise AssertionError(f"a command without an identity: {command!r}")


def identities(commands: Iterable[Command]) -> set[Effect]:
    return {effect for command in commands for effect in identity(command)}


def difference(needed: list[Command], in_flight: set[Effect]) -> list[Command]:
    """The commands of `needed` not in flight, in order; a Place keeps the requests of workers not asked for yet."""
    missing: list[Command] = []
    for command in needed:
        if isinstance(command, Place):
            requests = [r for r in command.requests if Effect("place", r.task_id, r.attempt) not in in_flight]
            if requests:
                missing.append(command.model_copy(update={"requests": requests}))
        elif not set(identity(command)) <= in_flight:
            missing.append(command)
    return missing


def one_offs(commands: Iterable[Command], needed: set[Effect]) -> list[Command]:
    """What `decide` issues that no record needs in flight, done once as it is issued: a release, the stop sent to
    the machine of a worker that is not on it (placed, not picked up yet), a replan's timer (a new run asks for the
    plan at once). The rest that is not `needed` (a timer a later move of the same decision made moot) is dropped."""
    return [
        command
        for command in commands
        if isinstance(command, Release)
        or (isinstance(command, ArmTimer) and command.timer is Timer.REPLAN)
        or (isinstance(command, Stop) and not set(identity(command)) <= needed)
    ]


def covered_in_a_live_run(job: JobRecord) -> set[Effect]:
    """What the record needs that a live workflow run need not start, as what it has in flight does it (a new run,
    which knows nothing of what the run before had in flight, starts them: `effects`):
    - the watcher of a gang member stopped at the barrier: it was never started (nothing runs to watch), and the
      stop sent to it, or its set-up in flight, tells its end (JobWorkflow._stop);
    - the restart timer of a worker stopped for a gang restart: it carries the failed worker's back-off, whose own
      timer, armed as it failed, queues them all (`job._gang_waiting`)."""
    covered: set[Effect] = set()
    for t in job.tasks:
        n = t.attempt.number
        if job.spec.gang and t.state is TaskState.STOPPING and t.on_node and not t.attempt.released:
            covered.add(Effect("run", t.id, n))
        if t.stop is not None and t.stop.cause == "gang_restart":
            covered.add(Effect("timer", t.id, n, Timer.RESTART.value))
    return covered


def effects(job: JobRecord, now: datetime) -> list[Command]:
    """What the record needs in flight now, in a fixed order: plans of groups not planned yet, room for the workers
    that wait, the barrier's timer, then each worker's (its restart timer; its start, set-up or supervisor; its
    stop in progress; its reset, time-limit and heartbeat-TTL timers). A timer already due fires at once."""
    commands: list[Command] = [*_plans(job)]
    waiting = [task_request(job, t) for t in job.tasks if t.waiting and not t.final and not t.gated]
    if waiting:
        commands.append(Place(requests=waiting))
    if job.barrier_since is not None:
        at = max(job.barrier_since + timedelta(seconds=job.settings.barrier_timeout_seconds), now)
        commands.append(ArmTimer(timer=Timer.BARRIER, task_id="", attempt=job.barrier_round, at=at))
    for task in job.tasks:
        if not task.final:
            commands += _task_effects(job, task, now)
    return commands


def _plans(job: JobRecord) -> list[Command]:
    """Groups of total_gpus not planned yet are asked about now (rather than after the replan interval)."""
    if job.tasks or job.cancel_requested:
        return []
    plans: list[Command] = []
    for group in unplanned(job):
        assert group.total_gpus is not None
        request = plan_request(job, group)
        plans.append(PlanGroup(group=group.name, request=request, total_gpus=group.total_gpus, machines=group.machines))
    return plans


def _task_effects(job: JobRecord, task: TaskRecord, now: datetime) -> list[Command]:
    """One task's effects (not final)."""
    ids = {"task_id": task.id, "attempt": task.attempt.number}
    commands: list[Command] = []
    if task.restart_at is not None:
        commands.append(ArmTimer(timer=Timer.RESTART, at=task.restart_at, **ids))
    if not task.on_node:
        return commands
    assert task.node is not None
    node = task.node
    if (
        task.placed_pending
        or task.state in (TaskState.PREPARING, TaskState.PULLING)
        or (task.state is TaskState.READY_TO_START and task.attempt.released)
    ):
        barrier = job.spec.gang and not task.attempt.released
        group, env = group_of(job, task), task_env(job, task)
        commands.append(Start(node=node, group=group, barrier=barrier, env=env, host_network=job.spec.gang, **ids))
        return commands
    if task.state is TaskState.READY_TO_START:
        return commands  # set up, waiting at the barrier: nothing runs to watch yet
    commands.append(Supervise(node=node, **ids))
    if task.state is TaskState.STOPPING:
        commands.append(Stop(node=node, **ids))
    return commands + _timers(job, task, now)


def _timers(job: JobRecord, task: TaskRecord, now: datetime) -> list[Command]:
    """The timers of a worker on its machine: those `decide` arms as it runs (`_running`) and goes Stale."""
    ids = {"task_id": task.id, "attempt": task.attempt.number}
    timers: list[Command] = []
    running_since, stale_since = task.attempt.running_since, task.attempt.stale_since
    if running_since is not None and task.state in (TaskState.RUNNING, TaskState.STALE):
        reset = running_since + timedelta(seconds=job.settings.restart_reset_seconds)
        if task.restarts > 0 or job.protocol < 2:  # a count of 0 has nothing to reset
            timers.append(ArmTimer(timer=Timer.RESET, at=max(reset, now), **ids))
        limit = group_of(job, task).time_limit_seconds
        if limit is not None:
            at = max(running_since + timedelta(seconds=limit), now)
            timers.append(ArmTimer(timer=Timer.TIME_LIMIT, at=at, **ids))
    if stale_since is not None and task.state is TaskState.STALE:
        at = max(stale_since + timedelta(seconds=heartbeat_ttl(job, task)), now)
        timers.append(ArmTimer(timer=Timer.STALE_TTL, at=at, **ids))
    return timers
