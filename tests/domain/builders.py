"""Machines, waiting workers and placed workers for the scheduler's pure tests, with readable defaults."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from workflows.domain.constraints import NodeSelection, Topology
from workflows.domain.inventory import GpuInfo, NetworkPort, NodeInventory, NodeState, NodeView
from workflows.domain.requests import Allocation, TaskRequest

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
GB = 10**9


def gpu(index: int, model: str = "NVIDIA H100 80GB HBM3", memory: int = 80 * GB, **health: str | None) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index}", model=model, memory_bytes=memory, **health)


def machine(
    name: str,
    *,
    cpus: float = 16,
    memory: int = 1 << 40,
    gpus: int | list[GpuInfo] = 0,
    state: NodeState = NodeState.READY,
    cordon: str | None = None,
    **inventory: Any,
) -> NodeView:
    gpu_list = [gpu(i) for i in range(gpus)] if isinstance(gpus, int) else gpus
    inv = NodeInventory(name=name, cpus=cpus, memory_bytes=memory, gpus=gpu_list, **inventory)
    return NodeView(name=name, state=state, inventory=inv, cordon=cordon)


def unreported(name: str) -> NodeView:
    return NodeView(name=name, state=NodeState.READY, inventory=None)


def ib(name: str = "mlx5_0", *, speed: int = 400, active: bool = True, fabric: str | None = "ib-0") -> NetworkPort:
    return NetworkPort(name=name, link="InfiniBand", active=active, speed_gbps=speed, fabric=fabric)


def request(
    task: str = "w-0",
    *,
    run: str = "a",
    namespace: str = "default",
    index: int | None = None,
    priority: int = 0,
    submitted: float = 0,
    cpu: float = 1,
    memory: int = 0,
    gpus: int = 0,
    limit: float | None = None,
    group: str = "w",
    **fields: Any,
) -> TaskRequest:
    if "selection" in fields and isinstance(fields["selection"], dict):
        fields["selection"] = NodeSelection(**fields["selection"])
    if "topology" in fields and isinstance(fields["topology"], dict):
        fields["topology"] = Topology(**fields["topology"])
    return TaskRequest(
        job_id=f"job/{namespace}/{run}",
        namespace=namespace,
        task_id=task,
        index=index if index is not None else int(task.rsplit("-", 1)[-1]) if task[-1].isdigit() else 0,
        attempt=0,
        priority=priority,
        submitted_at=T0 + timedelta(seconds=submitted),
        cpu=cpu,
        memory_bytes=memory,
        gpus=gpus,
        group=group,
        time_limit_seconds=limit,
        **fields,
    )


def holding(
    node: str,
    *,
    run: str = "other",
    namespace: str = "default",
    task: str = "x-0",
    cpu: float = 0,
    memory: int = 0,
    gpus: int = 0,
    priority: int = 0,
    started: float = 0,
    limit: float | None = None,
    group: str = "x",
) -> Allocation:
    """A placed worker: `started` seconds after T0, with an optional time limit."""
    return Allocation(
        job_id=f"job/{namespace}/{run}",
        task_id=task,
        attempt=0,
        node=node,
        cpu=cpu,
        memory_bytes=memory,
        gpus=gpus,
        priority=priority,
        group=group,
        started_at=T0 + timedelta(seconds=started),
        time_limit_seconds=limit,
    )


def at(minutes: float = 0) -> datetime:
    return T0 + timedelta(minutes=minutes)
