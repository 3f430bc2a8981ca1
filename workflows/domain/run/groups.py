"""Worker groups that wait for others (`depends_on`): held back from the scheduler until the groups they wait
for run (or pass their readiness check)."""

from __future__ import annotations

from workflows.domain.group_parts import Dependency
from workflows.domain.reasons import R, Reason
from workflows.domain.run.status import RUN_TERMINAL, JobRecord, TaskRecord, TaskState, record
from workflows.domain.run.step import Step

RUNNING = (TaskState.RUNNING, TaskState.STALE)


def _met(task: TaskRecord, dependency: Dependency) -> bool:
    if task.final and task.state is TaskState.COMPLETED:
        return True  # it ran to completion: what waited for it may go
    if task.state not in RUNNING:
        return False
    return dependency.condition == "running" or task.attempt.healthy is True


def unmet(job: JobRecord, group: str) -> Reason | None:
    """Why the group's workers still wait ("Waits for worker group <g> to be running"), or None."""
    spec = next(g for g in job.spec.groups if g.name == group)
    for dependency in spec.depends_on:
        workers = [t for t in job.tasks if t.group == dependency.group]
        if not all(_met(t, dependency) for t in workers):
            return R.WaitsForGroup(group=dependency.group, condition=dependency.condition)
    return None


def hold(job: JobRecord, tasks: list[TaskRecord]) -> list[TaskRecord]:
    """Mark the workers of waiting groups held back; returns the ones free to ask for a machine now."""
    free = []
    for task in tasks:
        if unmet(job, task.group) is not None:
            task.gated = True
        else:
            free.append(task)
    return free


def release_ready_groups(step: Step) -> None:
    """Held workers whose groups' dependencies are met ask for machines; the others show what they wait for."""
    job = step.job
    if job.state in RUN_TERMINAL or job.cancel_requested:
        return
    held = [t for t in job.tasks if t.gated and not t.final]
    ready = []
    for task in held:
        reason = unmet(job, task.group)
        if reason is None:
            task.gated = False
            record(task.status, task.history, task.state, R.WaitingForWorkersToStart(), step.now)
            ready.append(task)
        else:
            record(task.status, task.history, task.state, reason, step.now)
    step.place(*ready)
