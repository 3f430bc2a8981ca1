"""A run's workers: how they are planned from the spec, and what each asks of the scheduler."""

from __future__ import annotations

import zlib
from datetime import datetime

from workflows.domain.reasons import R
from workflows.domain.requests import Allocation, TaskRequest, placed_drives, request_fields
from workflows.domain.run.status import (
    TASK_ENDED,
    TASK_ON_NODE,
    JobRecord,
    RunState,
    Status,
    TaskRecord,
    TaskState,
    record,
)
from workflows.domain.settings import Settings
from workflows.domain.spec import GroupSpec, JobSpec


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


def groups_of(job: JobRecord) -> list[GroupSpec]:
    """The run's groups as they run: a group of total_gpus as the scheduler split it."""
    return [job.planned.get(g.name, g) for g in job.spec.groups]


def unplanned(job: JobRecord) -> list[GroupSpec]:
    """Groups of total_gpus the scheduler has not split into workers yet."""
    return [g for g in job.spec.groups if g.planned and g.name not in job.planned]


def plan_request(job: JobRecord, group: GroupSpec) -> TaskRequest:
    """One worker of a group of total_gpus, with everything but its GPU count: what planning asks about."""
    return _request(job, group, task_id=f"{group.name}-0", index=0, attempt=0, waiting_since=None)


def _request(
    job: JobRecord, group: GroupSpec, task_id: str, index: int, attempt: int, waiting_since: datetime | None
) -> TaskRequest:
    return TaskRequest(
        job_id=job.id,
        namespace=job.spec.namespace,
        task_id=task_id,
        index=index,
        attempt=attempt,
        priority=job.spec.priority,
        submitted_at=job.status.created_at,
        cpu=group.cpu,
        memory_bytes=group.worker_memory_bytes,
        gpus=group.gpus,
        waiting_since=waiting_since,
        **request_fields(job.spec, group),
    )


def split(group: GroupSpec, workers: int, gpus_per_worker: int) -> GroupSpec:
    """A group of total_gpus as planned: `workers` replicas of `gpus_per_worker`."""
    return group.model_copy(update={"replicas": workers, "gpus": gpus_per_worker, "total_gpus": None, "machines": None})


def plan_tasks(groups: list[GroupSpec], now: datetime) -> list[TaskRecord]:
    """One worker per replica of each group, named `<group>-<index>`."""
    reason = R.WaitingForWorkersToStart()
    tasks = []
    for group in groups:
        for index in range(group.replicas):
            status = Status(state=TaskState.PENDING, reason=reason.text, code=reason.code, created_at=now)
            task = TaskRecord(id=f"{group.name}-{index}", group=group.name, index=index, status=status)
            record(task.status, task.history, TaskState.PENDING, reason, now)
            tasks.append(task)
    return tasks


def group_of(job: JobRecord, task: TaskRecord) -> GroupSpec:
    planned = job.planned.get(task.group)
    return planned or next(g for g in job.spec.groups if g.name == task.group)


def task_request(job: JobRecord, task: TaskRecord) -> TaskRequest:
    """What a waiting worker asks of the scheduler."""
    group = group_of(job, task)
    return _request(job, group, task.id, job.tasks.index(task), task.attempt.number, waiting_since(task))


def waiting_since(task: TaskRecord) -> datetime | None:
    """When this attempt began to wait for a machine (patience windows count from it)."""
    since = None
    for entry in reversed(task.history):
        if entry.state != TaskState.PENDING:
            break
        since = entry.at
    return since


def allocation(job: JobRecord, task: TaskRecord) -> Allocation:
    """What a placed worker holds on its machine."""
    group = group_of(job, task)
    assert task.node is not None
    return Allocation(
        job_id=job.id,
        task_id=task.id,
        attempt=task.attempt.number,
        node=task.node,
        cpu=group.cpu,
        memory_bytes=group.worker_memory_bytes,
        gpus=group.gpus,
        priority=job.spec.priority,
        group=group.name,
        started_at=task.attempt.running_since,
        time_limit_seconds=group.time_limit_seconds,
        drives=placed_drives(group),
    )


# A gang's leader listens on a port derived from the run's id, the same on every attempt (MASTER_PORT).
MASTER_PORT_BASE, MASTER_PORT_SPAN = 20000, 10000


def master_port(job_id: str) -> int:
    return MASTER_PORT_BASE + zlib.crc32(job_id.encode()) % MASTER_PORT_SPAN


def rank(job: JobRecord, task: TaskRecord) -> int:
    """The worker's rank: its place in the run, except that a gang's leader is rank 0 (it is MASTER_ADDR)."""
    position = job.tasks.index(task)
    if not job.spec.gang:
        return position
    leader = job.tasks.index(job.task(job.spec.leader_id))
    if position == leader:
        return 0
    return position + 1 if position < leader else position


def task_env(job: JobRecord, task: TaskRecord) -> dict[str, str]:
    """What the run adds to a worker's environment: who it is, and for a gang how to find the others (the
    variables torch.distributed and other launchers read: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    env = {
        "ASTRAEUS_RUN": job.spec.name,
        "ASTRAEUS_NAMESPACE": job.spec.namespace,
        "ASTRAEUS_TASK": task.id,
        "ASTRAEUS_INDEX": str(task.index),
        "RANK": str(rank(job, task)),
        "WORLD_SIZE": str(len(job.tasks)),
    }
    if job.spec.gang:
        leader = job.task(job.spec.leader_id)
        # On the node network the leader is reached at the address its machine held for it there (a gang's groups
        # all ask it, or none: spec.py); else at its machine's address.
        master = leader.attempt.node_address if group_of(job, leader).on_mesh else leader.attempt.address
        if master is not None:
            env["MASTER_ADDR"] = master
        env["MASTER_PORT"] = str(master_port(job.id))
    return env


def nodes_in_use(job: JobRecord) -> list[str]:
    """Machines that hold a worker of this run now (search attribute AstraeusNodes)."""
    return sorted({t.node for t in job.tasks if t.node is not None and t.state in TASK_ON_NODE})


def heartbeat_ttl(job: JobRecord, task: TaskRecord) -> float:
    return group_of(job, task).heartbeat_ttl_seconds or job.settings.heartbeat_ttl_seconds


def attempts_on(job: JobRecord, node: str) -> dict[str, int]:
    """The attempt of each worker the run has on `node` now: an agent starts, and keeps running, only those."""
    return {t.id: t.attempt.number for t in job.tasks if t.node == node and t.on_node}


def asked_of_scheduler(job: JobRecord) -> tuple[list[TaskRequest], list[Allocation]]:
    """What the run asks of the scheduler (for a scheduler that rebuilds its view): its waiting workers' requests,
    and what its placed workers hold."""
    pending = [task_request(job, t) for t in job.tasks if t.waiting and not t.final and not t.gated]
    placed = [allocation(job, t) for t in job.tasks if t.node is not None and t.state not in TASK_ENDED]
    return pending, placed
