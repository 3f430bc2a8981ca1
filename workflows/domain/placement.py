"""Placement: which machine takes each waiting worker, and, when none does, why, machine by machine.

Pure: the scheduler service feeds it its view (requests, machines, allocations) and carries out the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from workflows.domain.nodes import NodeState, NodeView
from workflows.domain.reasons import R, Reason
from workflows.domain.status import NodeReasons


class TaskRequest(BaseModel):
    """One worker waiting for a machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_id: str
    namespace: str
    task_id: str
    index: int
    attempt: int
    priority: int
    submitted_at: datetime
    cpu: float
    memory_bytes: int
    gpus: int

    @property
    def key(self) -> tuple[str, str]:
        return (self.job_id, self.task_id)


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

    @property
    def key(self) -> tuple[str, str]:
        return (self.job_id, self.task_id)


@dataclass
class Free:
    """What is left on a machine."""

    cpu: float
    memory_bytes: int
    gpus: int


@dataclass(frozen=True)
class Decision:
    """A machine for the request, or the reason it waits with every machine's reasons."""

    request: TaskRequest
    node: str | None
    reason: Reason | None = None
    nodes: list[NodeReasons] = field(default_factory=list)


Check = Callable[[NodeView, Free, TaskRequest], Reason | None]


def _num(value: float) -> str:
    return f"{value:g}"


def check_ready(node: NodeView, free: Free, request: TaskRequest) -> Reason | None:
    """A machine that is Down, or has not reported what it has, takes nothing."""
    if node.state is not NodeState.READY:
        return R.NodeNotReady(state=node.state.value)
    if node.inventory is None:
        return R.NodeNoCapacity()
    return None


def check_cpu(node: NodeView, free: Free, request: TaskRequest) -> Reason | None:
    if request.cpu > free.cpu + 1e-9:
        return R.InsufficientCpu(need=_num(request.cpu), free=_num(max(free.cpu, 0)))
    return None


def check_memory(node: NodeView, free: Free, request: TaskRequest) -> Reason | None:
    if request.memory_bytes > free.memory_bytes:
        return R.InsufficientMemory(need=request.memory_bytes, free=max(free.memory_bytes, 0))
    return None


def check_gpus(node: NodeView, free: Free, request: TaskRequest) -> Reason | None:
    if request.gpus > free.gpus:
        return R.InsufficientGpus(need=request.gpus, free=max(free.gpus, 0))
    return None


# Fixed order, cheap first. Readiness short-circuits: a machine that is not ready has nothing else to say.
RESOURCE_CHECKS: tuple[Check, ...] = (check_cpu, check_memory, check_gpus)


def explain(node: NodeView, free: Free, request: TaskRequest) -> list[Reason]:
    """Every reason this machine does not take the request; empty when it fits."""
    not_ready = check_ready(node, free, request)
    if not_ready:
        return [not_ready]
    return [reason for check in RESOURCE_CHECKS if (reason := check(node, free, request))]


def free_capacity(nodes: Iterable[NodeView], allocations: Iterable[Allocation]) -> dict[str, Free]:
    """Capacity of each registered machine less what placed workers hold."""
    free: dict[str, Free] = {}
    for node in nodes:
        inv = node.inventory
        free[node.name] = Free(inv.cpus, inv.memory_bytes, len(inv.gpus)) if inv else Free(0, 0, 0)
    for alloc in allocations:
        if alloc.node in free:
            left = free[alloc.node]
            left.cpu -= alloc.cpu
            left.memory_bytes -= alloc.memory_bytes
            left.gpus -= alloc.gpus
    return free


def queue_order(request: TaskRequest) -> tuple[int, datetime, str, int]:
    """Higher priority first, then earlier claim; ties by run and worker for a stable order."""
    return (-request.priority, request.submitted_at, request.job_id, request.index)


def _tightness(free: Free, request: TaskRequest) -> tuple[float, float, int]:
    # Best fit: the machine left with the fewest GPUs, then CPUs, then memory, keeps big holes for big work.
    return (free.gpus - request.gpus, free.cpu - request.cpu, free.memory_bytes - request.memory_bytes)


def place(
    requests: Sequence[TaskRequest], nodes: Sequence[NodeView], allocations: Iterable[Allocation]
) -> list[Decision]:
    """Place waiting workers in queue order, best fit, on machines with room. One decision per request."""
    ordered_nodes = sorted(nodes, key=lambda n: n.name)
    free = free_capacity(ordered_nodes, allocations)
    ready = sum(n.state is NodeState.READY and n.inventory is not None for n in ordered_nodes)
    decisions = []
    for request in sorted(requests, key=queue_order):
        fits = [n for n in ordered_nodes if not explain(n, free[n.name], request)]
        if fits:
            best = min(fits, key=lambda n: (_tightness(free[n.name], request), n.name))
            left = free[best.name]
            left.cpu -= request.cpu
            left.memory_bytes -= request.memory_bytes
            left.gpus -= request.gpus
            decisions.append(Decision(request, best.name))
            continue
        reasons = [
            NodeReasons(name=n.name, reasons=[r.text for r in explain(n, free[n.name], request)]) for n in ordered_nodes
        ]
        waiting = R.NoMachineFits(ready=ready, total=len(ordered_nodes))
        if not ordered_nodes:
            waiting = R.NoMachinesRegistered(reason=waiting.text)
        decisions.append(Decision(request, None, waiting, reasons))
    return decisions
