"""The machines as placement reads them: each NodeView compiled once per pass, what is free on it, and an index
of the machines by free GPUs so that a request looks only at machines that could take it."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property

from workflows.domain.constraints import RACK_LABEL, GpuRequest
from workflows.domain.inventory import GpuInfo, NetworkPort, NodeState, NodeView
from workflows.domain.reasons import R, Reason
from workflows.domain.requests import Allocation, TaskRequest, allocation_for

EPSILON = 1e-9  # cpu is fractional: sums of quarters must compare equal


@dataclass
class Free:
    """What is left on a machine."""

    cpu: float
    memory_bytes: int
    gpus: int


@dataclass(eq=False)
class CompiledNode:
    """One machine, compiled from its NodeView: the facts every check reads, looked up once."""

    name: str
    not_ready: Reason | None
    pressure: Reason | None
    closed: Reason | None  # cordoned, or its agent takes no new runs
    labels: dict[str, str]
    pools: frozenset[str]
    accepts: tuple[tuple[str, str], ...]
    site: str | None
    ports: tuple[NetworkPort, ...]
    capabilities: frozenset[str]
    capability_notes: dict[str, str]
    data_free: int | None
    cpus: float
    memory_bytes: int
    gpus: tuple[GpuInfo, ...]
    faults: tuple[GpuInfo, ...]
    copies: frozenset[str] = frozenset()  # the drives it holds a filled copy of at its data location
    external_ports: int = 0  # how many ports its agent may assign to workers' external access
    _matching: dict[tuple[GpuRequest, ...], tuple[int, int]] = field(default_factory=dict)

    @cached_property
    def profile(self) -> tuple[object, ...]:
        """Every fact a check reads but the machine's name: machines with equal profiles and equal free room say
        the same to a worker that does not select by name or depend on where its run is."""
        gpus = tuple((g.model, g.memory_bytes, g.fault, g.at_risk, g.index if g.fault else -1) for g in self.gpus)
        return (self.not_ready, self.pressure, self.closed, tuple(sorted(self.labels.items())), self.pools,
                self.accepts, self.site, self.ports, self.capabilities, tuple(sorted(self.capability_notes.items())),
                self.data_free, self.copies, self.cpus, self.memory_bytes, gpus, self.external_ports)  # fmt: skip

    @property
    def rack(self) -> str | None:
        return self.labels.get(RACK_LABEL)

    @property
    def fabric(self) -> str | None:
        """The InfiniBand fabric its first active InfiniBand port is on."""
        return next((p.fabric for p in self.ports if p.link == "InfiniBand" and p.active and p.fabric), None)

    def matching(self, wanted: tuple[GpuRequest, ...]) -> tuple[int, int]:
        """(GPUs that match `wanted`, of which at risk); faulted GPUs count as neither."""
        known = self._matching.get(wanted)
        if known is None:
            good = [g for g in self.gpus if g.fault is None and (not wanted or any(gpu_matches(g, w) for w in wanted))]
            known = self._matching[wanted] = (len(good), sum(g.at_risk is not None for g in good))
        return known


def gpu_matches(gpu: GpuInfo, wanted: GpuRequest) -> bool:
    """A model matches the GPU's name as a word ("H100" in "NVIDIA H100 80GB HBM3"); the vendor likewise."""
    words = gpu.model.lower().replace("-", " ").split()
    if wanted.vendor and wanted.vendor.lower() not in words:
        return False
    if wanted.models and not any(m.lower() in words or m.lower() == gpu.model.lower() for m in wanted.models):
        return False
    return not (wanted.min_memory_bytes and gpu.memory_bytes < wanted.min_memory_bytes)


def compile_node(view: NodeView) -> CompiledNode:
    inv = view.inventory
    not_ready = None
    if inv is None:  # its agent never registered: "Down" is only the placeholder state of a machine not yet heard
        not_ready = R.NodeNoCapacity()
    elif view.state is not NodeState.READY:
        not_ready = R.NodeNotReady(state=view.state.value)
    closed = None
    if view.cordon is not None:
        closed = R.Cordoned(why=view.cordon or "no reason given")
    elif inv is not None and inv.refuses_runs is not None:
        closed = R.NotAcceptingRuns(why=inv.refuses_runs or "no reason given")
    if inv is None:
        return CompiledNode(view.name, not_ready, None, closed, {}, frozenset(), (), None, (), frozenset(), {}, None,
                       0.0, 0, (), ())  # fmt: skip
    gpus = tuple(sorted(inv.gpus, key=lambda g: g.index))
    return CompiledNode(
        name=view.name,
        not_ready=not_ready,
        pressure=R.UnderPressure(condition=", ".join(inv.pressure)) if inv.pressure else None,
        closed=closed,
        labels=dict(inv.labels),
        pools=frozenset(inv.pools),
        accepts=tuple(sorted(inv.accept_labels.items())),
        site=inv.site,
        ports=tuple(sorted(inv.ports, key=lambda p: p.name)),
        capabilities=frozenset(inv.capabilities),
        capability_notes=dict(inv.capability_notes),
        data_free=inv.data_free_bytes,
        cpus=inv.cpus,
        memory_bytes=inv.memory_bytes,
        gpus=gpus,
        faults=tuple(g for g in gpus if g.fault is not None),
        copies=frozenset(copy.drive for copy in inv.drive_copies),
        external_ports=inv.external_ports.size if inv.external_ports else 0,
    )


def size_text(size: int) -> str:
    """Bytes as people read a drive's size: 512 B, 1.5 KiB, 200 GiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.1f}".removesuffix(".0") + f" {unit}" if unit != "B" else f"{size} B"
        value /= 1024
    raise AssertionError("unreachable")


class Compiled:
    """Machines compiled in one pass and kept for the next: a machine is compiled again only when its view is a
    new object. Views are frozen, and the scheduler service replaces a machine's view when it changes, so the same
    object means the same facts. In a burst a pass runs every few milliseconds over machines that rarely change.
    What the placed workers hold is kept the same way (`holdings`): allocations are frozen too."""

    def __init__(self) -> None:
        self._kept: dict[str, tuple[NodeView, CompiledNode]] = {}
        self._holdings: Holdings | None = None
        self._held: dict[int, Allocation] = {}  # the allocations `_holdings` holds, by id

    def __call__(self, views: Iterable[NodeView]) -> dict[str, CompiledNode]:
        """Every view's machine, by name in name order."""
        kept: dict[str, tuple[NodeView, CompiledNode]] = {}
        for view in sorted(views, key=lambda v: v.name):
            old = self._kept.get(view.name)
            kept[view.name] = old if old is not None and old[0] is view else (view, compile_node(view))
        self._kept = kept
        return {name: machine for name, (_, machine) in kept.items()}

    def holdings(self, machines: dict[str, CompiledNode], allocations: list[Allocation]) -> Holdings:
        """What `allocations` hold on `machines`: the last pass's holdings, changed by the allocations that are new
        objects or gone since, on the same machines; else held anew. Read it, copy it; never change it."""
        now = {id(alloc): alloc for alloc in allocations}  # the same object means the same allocation
        kept = self._holdings
        if kept is not None and kept.same_machines(machines) and len(now) == len(allocations):
            kept.update(
                [a for i, a in self._held.items() if i not in now], [a for i, a in now.items() if i not in self._held]
            )
            if len(kept.allocations) == len(allocations):  # else two allocations of one worker: held anew, as given
                self._held = now
                return kept
        holdings = Holdings.of(machines, allocations)
        unique = len(now) == len(allocations) == len(holdings.allocations)
        self._holdings, self._held = (holdings, now) if unique else (None, {})  # one worker twice: kept no further
        return holdings


class Holdings:
    """What placed workers hold: free room on every machine, indexed by free GPUs, what each machine holds, and
    where each run's workers are. `Compiled` keeps one from pass to pass; each pass's Cluster begins as a copy."""

    machines: dict[str, CompiledNode]
    free: dict[str, Free]
    held: dict[str, dict[tuple[str, str], Allocation]]
    allocations: dict[tuple[str, str], Allocation]
    # Where each run's and each (run, group)'s workers are, counted by machine: plain dicts, as one is made per run
    # (a Counter each cost the scheduler's pass 40% of its time in a burst: bench/README.md).
    run_nodes: dict[str, dict[str, int]]
    group_nodes: dict[tuple[str, str], dict[str, int]]
    group_placed: Counter[tuple[str, str]]
    _buckets: list[list[tuple[float, int, str]]]
    # The runs and groups whose counts a copy made its own (copied at their first change); None: all of them.
    _own_runs: set[str] | None
    _own_groups: set[tuple[str, str]] | None

    @classmethod
    def of(cls, machines: dict[str, CompiledNode], allocations: Iterable[Allocation]) -> Holdings:
        """Every allocation held, in order, on the machines empty."""
        holdings = cls.__new__(cls)
        holdings.machines = machines
        holdings.free = {m.name: _capacity(m) for m in machines.values()}
        holdings.held = {name: {} for name in machines}
        holdings.allocations = {}
        holdings.run_nodes = {}
        holdings.group_nodes = {}
        holdings.group_placed = Counter()
        holdings._buckets = []
        holdings._own_runs = holdings._own_groups = None  # every count its own
        for alloc in allocations:
            holdings._hold(alloc, 1)
        for name, machine in machines.items():
            if machine.not_ready is None:
                holdings._index(name)
        return holdings

    def _copy(self, other: Holdings) -> None:
        """Become a copy of `other` that changes apart from it."""
        self.machines = other.machines
        self.free = {name: Free(f.cpu, f.memory_bytes, f.gpus) for name, f in other.free.items()}
        self.held = {name: dict(held) for name, held in other.held.items()}
        self.allocations = dict(other.allocations)
        self.run_nodes = dict(other.run_nodes)  # the counts of each run and group: shared until `_hold` changes them
        self.group_nodes = dict(other.group_nodes)
        self._own_runs = set()
        self._own_groups = set()
        self.group_placed = Counter(other.group_placed)
        self._buckets = [list(bucket) for bucket in other._buckets]

    def same_machines(self, machines: dict[str, CompiledNode]) -> bool:
        return machines.keys() == self.machines.keys() and all(self.machines[n] is m for n, m in machines.items())

    def update(self, gone: Iterable[Allocation], came: Iterable[Allocation]) -> None:
        """Let go of `gone`, then hold `came`. A machine whose holdings changed has its free room summed again
        from what it holds, as `of` sums it, so that no rounding builds up from pass to pass."""
        touched: dict[str, None] = {}
        for sign, allocs in ((-1, gone), (1, came)):
            for alloc in allocs:
                machine = self.machines.get(alloc.node)
                if machine is not None and alloc.node not in touched:
                    touched[alloc.node] = None
                    if machine.not_ready is None:
                        self._unindex(alloc.node)
                self._hold(alloc, sign)
        for alloc in gone:  # a run or group with nothing held left is forgotten, as `of` never knew it
            group = (alloc.job_id, alloc.group)
            if not self.run_nodes.get(alloc.job_id, True):
                del self.run_nodes[alloc.job_id]
            if not self.group_nodes.get(group, True):
                del self.group_nodes[group]
            if group in self.group_placed and self.group_placed[group] <= 0:
                del self.group_placed[group]
        for name in touched:
            free = self.free[name] = _capacity(self.machines[name])
            for alloc in self.held[name].values():
                free.cpu -= alloc.cpu
                free.memory_bytes -= alloc.memory_bytes
                free.gpus -= alloc.gpus
            if self.machines[name].not_ready is None:
                self._index(name)

    # ---- the index ----------------------------------------------------------------------------------------------

    def _entry(self, name: str) -> tuple[int, tuple[float, int, str]]:
        free = self.free[name]
        return max(free.gpus, 0), (free.cpu, free.memory_bytes, name)

    def _index(self, name: str) -> None:
        gpus, entry = self._entry(name)
        while len(self._buckets) <= gpus:
            self._buckets.append([])
        insort(self._buckets[gpus], entry)

    def _unindex(self, name: str) -> None:
        gpus, entry = self._entry(name)
        bucket = self._buckets[gpus]
        del bucket[bisect_left(bucket, entry)]

    def _hold(self, alloc: Allocation, sign: int) -> None:
        if self._own_runs is not None and alloc.job_id not in self._own_runs:  # a copy's first change to them
            self._own_runs.add(alloc.job_id)
            if (shared := self.run_nodes.get(alloc.job_id)) is not None:
                self.run_nodes[alloc.job_id] = dict(shared)
        group_key = (alloc.job_id, alloc.group)
        if self._own_groups is not None and group_key not in self._own_groups:
            self._own_groups.add(group_key)
            if (shared_group := self.group_nodes.get(group_key)) is not None:
                self.group_nodes[group_key] = dict(shared_group)
        held = self.held.get(alloc.node)
        if sign > 0:
            self.allocations[alloc.key] = alloc
            if held is not None:
                held[alloc.key] = alloc
        else:
            self.allocations.pop(alloc.key, None)
            if held is not None:
                held.pop(alloc.key, None)
        run_nodes = self.run_nodes.get(alloc.job_id)
        if run_nodes is None:
            run_nodes = self.run_nodes[alloc.job_id] = {}
        group_nodes = self.group_nodes.get(group_key)
        if group_nodes is None:
            group_nodes = self.group_nodes[group_key] = {}
        for nodes in (run_nodes, group_nodes):
            count = nodes.get(alloc.node, 0) + sign
            if count > 0:
                nodes[alloc.node] = count
            else:
                nodes.pop(alloc.node, None)
        self.group_placed[group_key] += sign
        free = self.free.get(alloc.node)
        if free is not None:
            free.cpu -= sign * alloc.cpu
            free.memory_bytes -= sign * alloc.memory_bytes
            free.gpus -= sign * alloc.gpus


def _capacity(machine: CompiledNode) -> Free:
    return Free(machine.cpus, machine.memory_bytes, len(machine.gpus))


class Cluster(Holdings):
    """A pass's view: the holdings as the pass began (copied from those `compiled` kept), changed in place as the
    pass places workers; `version` and `changed` tell caches what moved."""

    def __init__(
        self,
        views: Iterable[NodeView],
        allocations: Iterable[Allocation],
        now: datetime,
        compiled: Compiled | None = None,
    ) -> None:
        self.now = now
        compiled = compiled or Compiled()
        machines = compiled(views)
        self._copy(compiled.holdings(machines, list(allocations)))
        self.names: list[str] = list(self.machines)
        self.version = 0
        self.changed: list[str] = []  # the machine changed by each version, in order: changed[v - 1]
        # Tentative changes since the pass began, so that they can be undone exactly: each placement with the
        # allocation its key held before (a worker asked again while its old attempt still holds room), and each
        # lifted allocation (a preemption victim, as a head sees it once gone) with None.
        self._placed: list[tuple[Allocation, Allocation | None, bool]] = []
        self.node_version: Counter[str] = Counter()  # changes to each machine's room: keys for `memo`
        self.memo: dict[tuple[object, ...], object] = {}  # answers about a machine, keyed with its node_version
        self._closed: set[str] = set()  # out of the index for the rest of the pass

    @cached_property
    def by_size(self) -> list[str]:
        """Ready machines, smallest first (GPUs, cpus, memory, name): first fit in this order is best fit on an
        empty cluster."""
        ready = (m for m in self.machines.values() if m.not_ready is None)
        return [m.name for m in sorted(ready, key=lambda m: (len(m.gpus), m.cpus, m.memory_bytes, m.name))]

    def changed_since(self, version: int) -> set[str]:
        return set(self.changed[version:])

    def candidates(self, request: TaskRequest) -> Iterator[str]:
        """Ready machines with at least the GPUs, cpu and memory asked free, tightest first (best fit): fewest GPUs
        left, then fewest cpus, then least memory, then by name. The index may change between two yields."""
        for gpus in range(max(request.gpus, 0), len(self._buckets)):
            bucket = self._buckets[gpus]
            i = bisect_left(bucket, (request.cpu - EPSILON,))
            while i < len(bucket):
                _, memory, name = bucket[i]
                i += 1
                if memory >= request.memory_bytes:
                    yield name

    # ---- changes ------------------------------------------------------------------------------------------------

    def close(self, name: str) -> None:
        """Nothing starts on the machine for the rest of the pass (a head holds it, its start unknown): placement
        no longer looks at it."""
        if name not in self._closed and name in self.machines and self.machines[name].not_ready is None:
            self._unindex(name)
            self._closed.add(name)

    def _change(self, alloc: Allocation, sign: int) -> None:
        node = alloc.node
        indexed = node in self.machines and self.machines[node].not_ready is None and node not in self._closed
        if indexed:
            self._unindex(node)
        self._hold(alloc, sign)
        if indexed:
            self._index(node)
        self.version += 1
        self.node_version[node] += 1
        self.changed.append(node)

    def place(self, request: TaskRequest, node: str, *, until_released: bool = False) -> Allocation:
        """`request` takes its room on `node` now; `until_released`: as if it had no time limit (a head's member
        held in place while the next one looks for room must not seem to free it when its limit passes)."""
        alloc = allocation_for(request, node, self.now)
        if until_released:
            alloc = alloc.model_copy(update={"time_limit_seconds": None})
        self._placed.append((alloc, self.allocations.get(alloc.key), True))
        self._change(alloc, 1)
        return alloc

    def lift(self, alloc: Allocation) -> None:
        """`alloc`'s room is free until `rollback`: a victim as the head it would make room for sees it once gone."""
        if alloc.key in self.held.get(alloc.node, {}):
            self._placed.append((alloc, None, False))
            self._change(alloc, -1)

    def mark(self) -> int:
        """A savepoint: `rollback(mark)` undoes every placement and lift made after it."""
        return len(self._placed)

    def rollback(self, mark: int) -> None:
        """Undo the placements and lifts made since `mark`, latest first, as if they had never been made."""
        while len(self._placed) > mark:
            alloc, before, placed = self._placed.pop()
            if not placed:
                self._change(alloc, 1)
                continue
            self.release(alloc)
            if before is not None:  # the same worker's older attempt: it still holds its room, as before
                self.allocations[before.key] = before
                held = self.held.get(before.node)
                if held is not None:
                    held[before.key] = before

    def placed_count(self, job_id: str) -> int:
        """How many workers of the run hold room."""
        return sum(self.run_nodes.get(job_id, {}).values())

    def release(self, alloc: Allocation) -> None:
        """`alloc`'s room is free again (an undone placement, or a preempted worker as its head sees it)."""
        if alloc.key in self.held.get(alloc.node, {}):
            self._change(alloc, -1)

    def fabrics_of(self, job_id: str) -> frozenset[str]:
        """The InfiniBand fabrics of the machines its run's workers are on (placed or tentatively placed)."""
        machines = (self.machines.get(node) for node in self.run_nodes.get(job_id, {}))
        return frozenset(m.fabric for m in machines if m is not None and m.fabric is not None)

    def racks_of(self, job_id: str) -> Counter[str]:
        racks: Counter[str] = Counter()
        for node, count in self.run_nodes.get(job_id, {}).items():
            machine = self.machines.get(node)
            if machine is not None and machine.rack is not None:
                racks[machine.rack] += count
        return racks


def free_capacity(nodes: Iterable[NodeView], allocations: Iterable[Allocation]) -> dict[str, Free]:
    """Capacity of each registered machine less what placed workers hold."""
    return Cluster(nodes, allocations, datetime.min).free
