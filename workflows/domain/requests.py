"""What a waiting worker asks of the scheduler (TaskRequest) and what a placed one holds (Allocation)."""

from __future__ import annotations

from datetime import datetime, timedelta
from functools import cached_property
from typing import Any

from pydantic import BaseModel, ConfigDict

from workflows.domain.constraints import Capability, GpuRequest, Network, NodeSelection, Topology
from workflows.domain.spec import GroupSpec, JobSpec

# (job id, task id): one task of one run anywhere in the cluster, what its request and its allocation are keyed by.
JobTaskKey = tuple[str, str]


def run_name(job_id: str) -> str:
    """`job/<ns>/<name>` -> `<name>`: how reasons name a run."""
    return job_id.split("/", 2)[-1]


def namespace_of(job_id: str) -> str:
    parts = job_id.split("/", 2)
    return parts[1] if len(parts) == 3 else ""


class TaskRequest(BaseModel):
    """One worker waiting for a machine, with everything placement needs to know about it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    namespace: str
    task_id: str
    index: int
    attempt: int
    priority: int
    submitted_at: datetime  # the run's claim: earlier claims go first at equal priority
    cpu: float
    memory_bytes: int
    gpus: int
    group: str = ""
    time_limit_seconds: float | None = None  # known end: the worker may backfill
    waiting_since: datetime | None = None  # when this attempt began to wait (patience counts from it)
    selection: NodeSelection | None = None
    gpu_requests: tuple[GpuRequest, ...] = ()  # any of these GPUs; empty: any GPU
    healthy_only: bool = False
    network: Network | None = None
    topology: Topology | None = None
    drives: tuple[str, ...] = ()
    capabilities: tuple[Capability, ...] = ()
    max_parallel: int | None = None  # array.max_parallel: placed workers of its group at once
    gang: bool = False  # its run's waiting workers are placed together or not at all; quota asked for all
    min_available: int | None = None  # a gang: this many of its first workers (placed ones count) suffice
    spread: bool = False  # a worker of a group of total_gpus: at most one worker of its group per machine
    external_ports: int = 0  # external_access: ports its machine must assign it
    memory_per_gpu_bytes: int = 0  # per_gpu.memory_bytes: memory_bytes is gpus x this (planning sizes by it); 0: none

    @property
    def key(self) -> JobTaskKey:
        return (self.job_id, self.task_id)

    @property
    def run(self) -> str:
        return run_name(self.job_id)

    @property
    def since(self) -> datetime:
        return self.waiting_since or self.submitted_at

    @cached_property
    def shape(self) -> tuple[object, ...]:
        """Everything that decides which machines fit it; equal shapes get equal per-machine reasons."""
        return (
            self.cpu,
            self.memory_bytes,
            self.gpus,
            self.selection.key() if self.selection else None,
            self.gpu_requests,
            self.healthy_only,
            self.network,
            self.topology,
            self.drives,
            self.capabilities,
            self.spread,
            self.external_ports,
        )

    @property
    def with_run(self) -> bool:
        """Whether where its run's other workers are changes which machines fit it."""
        topology = self.topology
        if self.gang and self.network is not None and self.network.infiniband:
            return True  # its gang stays on the fabric of its members placed first
        return self.spread or (
            topology is not None
            and (
                topology.one_machine
                or topology.same_rack
                or topology.one_per_rack
                or topology.one_per_machine
                or topology.max_machines is not None
                or topology.patience_seconds is not None  # it waits for its run's fabric
            )
        )


class Allocation(BaseModel):
    """What one placed worker holds on its machine until it is released."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    task_id: str
    attempt: int
    node: str
    cpu: float
    memory_bytes: int
    gpus: int
    priority: int = 0
    group: str = ""
    started_at: datetime | None = None  # running since (or placed at); with the time limit, when it ends
    time_limit_seconds: float | None = None
    drives: tuple[str, ...] = ()  # the catalogue's drives it mounts: a drive in use is not removed

    @property
    def key(self) -> JobTaskKey:
        return (self.job_id, self.task_id)

    @property
    def namespace(self) -> str:
        return namespace_of(self.job_id)

    @property
    def run(self) -> str:
        return run_name(self.job_id)

    def ends_at(self, now: datetime) -> datetime | None:
        """When its time limit stops it at the latest; None when it has no limit."""
        if self.time_limit_seconds is None:
            return None
        return later(self.started_at or now, self.time_limit_seconds)


def later(at: datetime, seconds: float) -> datetime | None:
    """`seconds` after `at`; None when that is no date: a limit from before limits were bounded (past the year
    9999), which counts as no limit, so that one run's record never stops a scheduling pass."""
    try:
        return at + timedelta(seconds=seconds)
    except (OverflowError, ValueError):
        return None


def allocation_for(request: TaskRequest, node: str, now: datetime) -> Allocation:
    """What a request holds once placed on `node` at `now`."""
    return Allocation(
        job_id=request.job_id,
        task_id=request.task_id,
        attempt=request.attempt,
        node=node,
        cpu=request.cpu,
        memory_bytes=request.memory_bytes,
        gpus=request.gpus,
        priority=request.priority,
        group=request.group,
        started_at=now,
        time_limit_seconds=request.time_limit_seconds,
        drives=request.drives,
    )


def request_fields(spec: JobSpec, group: GroupSpec) -> dict[str, Any]:
    """The placement fields of a worker of `group`, for `TaskRequest(**ids, **request_fields(spec, group))`."""
    selection = spec.node_selection.merged(group.node_selection) if spec.node_selection else group.node_selection
    return {
        "group": group.name,
        "time_limit_seconds": group.time_limit_seconds,
        "selection": selection,
        "gpu_requests": tuple(group.gpu_requests or ()),
        "healthy_only": bool(group.healthy_only),
        "network": group.network,
        "capabilities": group.capabilities.checked() if group.capabilities else (),
        "topology": spec.topology,
        "max_parallel": group.array.max_parallel if group.array else None,
        "gang": spec.gang,
        "min_available": spec.min_available,
        # A group of total_gpus is planned one worker per machine (workflows/domain/scheduling/planning.py): placement
        # keeps it so.
        "spread": any(g.name == group.name and g.planned for g in spec.groups),
        "drives": placed_drives(group),
        "memory_per_gpu_bytes": group.per_gpu.memory_bytes if group.per_gpu else 0,
        "external_ports": len(group.external_access),
    }


def placed_drives(group: GroupSpec) -> tuple[str, ...]:
    """The catalogue's drives a worker of `group` mounts: the scheduler places it where their data can be."""
    return tuple(d.drive for d in group.drives if d.drive is not None)
