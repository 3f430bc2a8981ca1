"""A run's workers: how they are planned from the spec, and what each asks of the scheduler."""

from __future__ import annotations

from datetime import datetime

from workflows.domain.placement import Allocation, TaskRequest
from workflows.domain.reasons import R
from workflows.domain.requests import request_fields
from workflows.domain.settings import Settings
from workflows.domain.spec import GroupSpec, JobSpec
from workflows.domain.status import TASK_ON_NODE, JobRecord, RunState, Status, TaskRecord, TaskState, record


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
        **request_fields(job.spec, group),
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
        priority=job.spec.priority,
        group=group.name,
        started_at=task.running_since,
        time_limit_seconds=group.time_limit_seconds,
    )


def nodes_in_use(job: JobRecord) -> list[str]:
    """Machines that hold a worker of this run now (search attribute AstraeusNodes)."""
    return sorted({t.node for t in job.tasks if t.node is not None and t.state in TASK_ON_NODE})


def heartbeat_ttl(job: JobRecord, task: TaskRecord) -> float:
    return group_of(job, task).heartbeat_ttl_seconds or job.settings.heartbeat_ttl_seconds
