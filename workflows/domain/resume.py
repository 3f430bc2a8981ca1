"""Picking a run up where its previous workflow run left it (continue-as-new)."""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.domain.events import ArmTimer, Command, Place, PlanWorkers, Start, Stop, Supervise, Timer
from workflows.domain.status import JobRecord, TaskState
from workflows.domain.tasks import group_of, heartbeat_ttl, plan_request, task_env, task_request, unplanned


def resume(job: JobRecord, now: datetime) -> list[Command]:
    """Commands that pick a run up where its previous workflow run left it (continue-as-new): re-ask for room,
    re-arm timers, re-attach to workers on machines (never start them again) and repeat stops in progress."""
    commands: list[Command] = []
    if not job.tasks and not job.cancel_requested:
        for group in unplanned(job):  # ask again now rather than wait out the 60 s
            assert group.total_gpus is not None
            request = plan_request(job, group)
            commands.append(
                PlanWorkers(group=group.name, request=request, total_gpus=group.total_gpus, machines=group.machines)
            )
    waiting = [task_request(job, t) for t in job.tasks if t.waiting and not t.final and not t.gated]
    if waiting:
        commands.append(Place(requests=waiting))
    if job.barrier_since is not None:
        at = max(job.barrier_since + timedelta(seconds=job.settings.barrier_timeout_seconds), now)
        commands.append(ArmTimer(timer=Timer.BARRIER, task_id="", attempt=job.barrier_round, at=at))
    for task in job.tasks:
        if task.final:
            continue
        ids = {"task_id": task.id, "attempt": task.attempt.number}
        if task.restart_at is not None:
            commands.append(ArmTimer(timer=Timer.RESTART, at=task.restart_at, **ids))
        if not task.on_node:
            continue
        assert task.node is not None
        node = task.node
        if (
            task.placed_pending
            or task.state in (TaskState.PREPARING, TaskState.PULLING)
            or (task.state is TaskState.READY_TO_START and task.attempt.released)
        ):
            barrier = job.spec.gang and not task.attempt.released
            commands.append(
                Start(
                    node=node,
                    group=group_of(job, task),
                    barrier=barrier,
                    env=task_env(job, task),
                    host_network=job.spec.gang,
                    **ids,
                )
            )
            continue
        if task.state is TaskState.READY_TO_START:
            continue  # set up, waiting at the barrier: nothing runs to watch yet
        commands.append(Supervise(node=node, **ids))
        if task.state is TaskState.STOPPING:
            commands.append(Stop(node=node, **ids))
        running_since, stale_since = task.attempt.running_since, task.attempt.stale_since
        if running_since is not None and task.state in (TaskState.RUNNING, TaskState.STALE):
            reset = running_since + timedelta(seconds=job.settings.restart_reset_seconds)
            if task.restarts > 0 or job.protocol < 2:
                commands.append(ArmTimer(timer=Timer.RESET, at=max(reset, now), **ids))
            limit = group_of(job, task).time_limit_seconds
            if limit is not None:
                at = max(running_since + timedelta(seconds=limit), now)
                commands.append(ArmTimer(timer=Timer.TIME_LIMIT, at=at, **ids))
        if stale_since is not None and task.state is TaskState.STALE:
            at = max(stale_since + timedelta(seconds=heartbeat_ttl(job, task)), now)
            commands.append(ArmTimer(timer=Timer.STALE_TTL, at=at, **ids))
    return commands
