"""What the cluster holds now, as the console's machines and quotas pages show it: each machine's free room and
each workspace's use, counted from what placed workers hold, as the scheduler counts them when it rebuilds its
view (`activities/scheduler.py`: every open run's placed workers) and as a quota counts them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict

from workflows.domain.inventory import NodeView
from workflows.domain.requests import Allocation
from workflows.domain.scheduling.machines import free_capacity
from workflows.domain.scheduling.quotas import usage_by_namespace


class Room(BaseModel):
    """GPUs, CPU cores and memory: free on a machine, or held by a workspace."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpus: int
    cpu: float
    memory_bytes: int


class PlacedWorker(Room):
    """One placed worker and what it holds."""

    namespace: str
    run: str
    task: str


class MachineRoom(Room):
    """A machine's capacity less what its placed workers hold (may be below 0 while a worker that outlived its
    room is being stopped, as the scheduler counts it too), and those workers."""

    name: str
    workers: int
    placed: list[PlacedWorker]

    def seen_by(self, namespace: str) -> MachineRoom:
        """As a workspace's token sees it: its own workers named, the others only counted."""
        return self.model_copy(update={"placed": [p for p in self.placed if p.namespace == namespace]})


class WorkspaceUse(Room):
    """What a workspace's placed workers hold, as its quota counts it."""

    namespace: str
    workers: int


class ClusterUse(BaseModel):
    """`GET /usage`: every registered machine's free room and every workspace's use, by name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    machines: list[MachineRoom]
    workspaces: list[WorkspaceUse]


def cluster_use(nodes: Iterable[NodeView], allocations: Iterable[Allocation]) -> ClusterUse:
    """Free room of each machine that reported its capacity, and use of each workspace with placed workers."""
    reported = [n for n in nodes if n.inventory is not None]
    allocations = list(allocations)
    on_machine = Counter(a.node for a in allocations)
    of_workspace = Counter(a.namespace for a in allocations)
    placed: dict[str, list[PlacedWorker]] = {}
    for a in sorted(allocations, key=lambda a: a.key):
        worker = PlacedWorker(namespace=a.namespace, run=a.job_id.split("/", 2)[2], task=a.task_id, gpus=a.gpus,
                              cpu=a.cpu, memory_bytes=a.memory_bytes)  # fmt: skip
        placed.setdefault(a.node, []).append(worker)
    machines = []
    for name, room in sorted(free_capacity(reported, allocations).items()):
        held = {"workers": on_machine[name], "placed": placed.get(name, [])}
        machines.append(MachineRoom(name=name, gpus=room.gpus, cpu=room.cpu, memory_bytes=room.memory_bytes, **held))
    workspaces = [
        WorkspaceUse(
            namespace=ns, gpus=used.gpus, cpu=used.cpu, memory_bytes=used.memory_bytes, workers=of_workspace[ns]
        )
        for ns, used in sorted(usage_by_namespace(allocations).items())
    ]
    return ClusterUse(machines=machines, workspaces=workspaces)
