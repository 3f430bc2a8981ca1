"""The head of the queue holds room: when its worker can start (from the time limits of the work that runs), on
which machine, and which other workers may still start there now (backfill) without delaying it.

EASY backfill, per machine: the head reserves the machine where it starts soonest. Another worker may start on
that machine now only if it ends (by its time limit) before the head's start, or if it leaves the head enough room
at that start. Machines the head does not reserve are free for anyone.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from workflows.domain.requests import TaskRequest, later
from workflows.domain.scheduling.machines import Cluster, Free
from workflows.domain.scheduling.placement import Ask, ask_key, fits, fits_empty


@dataclass(frozen=True)
class Reservation:
    """Room held on `node` for a head worker from `at` (None: from when work without a time limit ends)."""

    ask: Ask
    node: str
    at: datetime | None

    @property
    def request(self) -> TaskRequest:
        return self.ask.request


def _free_at(cluster: Cluster, node: str, at: datetime) -> Free:
    """What will be free on `node` at `at` if nothing new starts: now's free plus what ends by then."""
    free = cluster.free[node]
    result = Free(free.cpu, free.memory_bytes, free.gpus)
    for alloc in cluster.held[node].values():
        end = alloc.ends_at(cluster.now)
        if end is not None and end <= at:
            result.cpu += alloc.cpu
            result.memory_bytes += alloc.memory_bytes
            result.gpus += alloc.gpus
    return result


def earliest_start(cluster: Cluster, node: str, ask: Ask) -> datetime | None:
    """When the worker fits on `node` as time-limited work ends; None when that takes work without a limit.
    Remembered until the machine's room changes (a gang head asks it of every machine for every member)."""
    key = ("start", node, cluster.node_version[node], *ask_key(ask))
    if key not in cluster.memo:
        cluster.memo[key] = _earliest_start(cluster, node, ask)
    start: datetime | None = cluster.memo[key]  # type: ignore[assignment]
    return start


def _earliest_start(cluster: Cluster, node: str, ask: Ask) -> datetime | None:
    machine = cluster.machines[node]
    if fits(machine, cluster.free[node], ask):
        return cluster.now
    ends = sorted({end for a in cluster.held[node].values() if (end := a.ends_at(cluster.now)) is not None})
    for end in ends:
        if fits(machine, _free_at(cluster, node, end), ask):
            return max(end, cluster.now)
    return None


Rank = tuple[bool, bool, datetime, int, str]


def _rank(cluster: Cluster, name: str, ask: Ask, taken: set[str]) -> tuple[Rank, datetime | None] | None:
    """How good a place to wait `name` is (lower is better) and when the worker starts there; None when the
    machine would never take it."""
    if cluster.machines[name].not_ready is not None or not _fits_empty(cluster, name, ask):
        return None
    at = earliest_start(cluster, name, ask)
    missing = max(ask.request.gpus - cluster.free[name].gpus, 0)
    return (name in taken, at is None, at or datetime.max.replace(tzinfo=cluster.now.tzinfo), missing, name), at


def reserve(cluster: Cluster, ask: Ask, names: list[str], taken: set[str]) -> Reservation | None:
    """The machine where the worker starts soonest: known times first, then the machine missing the fewest GPUs,
    then by name; a machine another head worker holds only when no other will do. None when no machine would
    ever take it."""
    ranks = (ranked for name in names if (ranked := _rank(cluster, name, ask, taken)) is not None)
    best = min(ranks, default=None)
    return Reservation(ask, best[0][-1], best[1]) if best is not None else None


class Reserving:
    """`reserve` for the members of a head gang, one after the other, each held in place before the next asks:
    the machines are ranked once per shape, and a machine again only once its room changed. Exact because rooms
    only shrink while it is used (a member held in place never makes a machine a better place to wait)."""

    def __init__(self, cluster: Cluster, names: list[str], taken: set[str]) -> None:
        self.cluster, self.names, self.taken = cluster, names, taken
        self._heaps: dict[tuple[object, ...], list[tuple[Rank, datetime | None, int]]] = {}

    def reserve(self, ask: Ask) -> Reservation | None:
        cluster = self.cluster
        if ask.request.with_run:  # where its run already is changes every machine's answer
            return reserve(cluster, ask, self.names, self.taken)
        key = ask_key(ask)
        heap = self._heaps.get(key)
        if heap is None:
            heap = [(*r, cluster.node_version[n]) for n in self.names if (r := _rank(cluster, n, ask, self.taken))]
            heapq.heapify(heap)
            self._heaps[key] = heap
        while heap:
            rank, at, version = heap[0]
            name = rank[-1]
            if cluster.node_version[name] == version:
                return Reservation(ask, name, at)
            ranked = _rank(cluster, name, ask, self.taken)
            assert ranked is not None  # whether a machine would ever take it does not change with its room
            heapq.heapreplace(heap, (*ranked, cluster.node_version[name]))
        return None


def _fits_empty(cluster: Cluster, node: str, ask: Ask) -> bool:
    key = ("empty", node, *ask_key(ask))
    if key not in cluster.memo:
        cluster.memo[key] = fits_empty(cluster.machines[node], ask)
    return bool(cluster.memo[key])


@dataclass
class _Refusals:
    count: int  # reservations then
    version: int  # the cluster's version then
    nodes: set[str]


@dataclass
class Reservations:
    """Every reservation of this pass, by machine."""

    by_node: dict[str, list[Reservation]] = field(default_factory=dict)
    count: int = 0
    _refusals: dict[tuple[object, ...], _Refusals] = field(default_factory=dict)
    _added: list[Reservation] = field(default_factory=list)  # in order, for `rollback`

    def add(self, reservation: Reservation) -> None:
        self.by_node.setdefault(reservation.node, []).append(reservation)
        self.count += 1
        self._added.append(reservation)

    def mark(self) -> int:
        """A savepoint: `rollback(mark)` takes back every reservation added after it."""
        return len(self._added)

    def rollback(self, mark: int) -> None:
        while len(self._added) > mark:
            reservation = self._added.pop()
            held = self.by_node[reservation.node]
            held.pop()  # the latest of its machine: reservations are taken back latest first
            if not held:
                del self.by_node[reservation.node]
            self.count -= 1
        self._refusals.clear()  # counted by `count`, which may come back to a value it had with other holds

    def refusing(self, cluster: Cluster, ask: Ask) -> set[str]:
        """The held machines where the worker may not start now (see `allows`). Remembered per size of worker and
        brought up to date with the machines changed since: a gang head holds many machines, and each of the
        thousands of workers behind it would otherwise ask each of them again."""
        if not self.by_node:
            return set()
        request = ask.request
        size = (request.cpu, request.memory_bytes, request.gpus, request.time_limit_seconds)
        known = self._refusals.get(size)
        if known is None or known.count != self.count:
            nodes = {node for node in self.by_node if not self.allows(cluster, node, ask)}
            known = self._refusals[size] = _Refusals(self.count, cluster.version, nodes)
        elif known.version != cluster.version:
            for node in cluster.changed_since(known.version):
                if node in self.by_node:
                    if self.allows(cluster, node, ask):
                        known.nodes.discard(node)
                    else:
                        known.nodes.add(node)
            known.version = cluster.version
        return known.nodes

    @property
    def nodes(self) -> set[str]:
        return set(self.by_node)

    def allows(self, cluster: Cluster, node: str, ask: Ask) -> bool:
        """Whether the worker may start on `node` now without delaying any head that holds room there. Remembered
        until the machine's room or its holds change: a gang head holds many machines that the queue behind it
        looks at again and again."""
        held = self.by_node.get(node)
        if not held:
            return True
        request = ask.request
        key = ("allows", node, cluster.node_version[node], len(held), request.cpu, request.memory_bytes,
               request.gpus, request.time_limit_seconds)  # fmt: skip
        if key not in cluster.memo:
            cluster.memo[key] = self._allows(cluster, node, held, request)
        return bool(cluster.memo[key])

    @staticmethod
    def _allows(cluster: Cluster, node: str, held: list[Reservation], request: TaskRequest) -> bool:
        for reservation in held:
            if reservation.at is None:
                return False  # no start time known: nothing can be shown not to delay it
            ends = later(cluster.now, request.time_limit_seconds) if request.time_limit_seconds is not None else None
            if ends is not None and ends <= reservation.at:
                continue  # backfill: it is gone before the head starts
            room = _free_at(cluster, node, reservation.at)
            for other in held:
                if other is not reservation:
                    _take(room, other.request)
            _take(room, request)
            if not fits(cluster.machines[node], room, reservation.ask):
                return False
        return True


def _take(free: Free, request: TaskRequest) -> None:
    free.cpu -= request.cpu
    free.memory_bytes -= request.memory_bytes
    free.gpus -= request.gpus


def by_minute(at: datetime) -> datetime:
    """Start times are shown to the minute, rounded up: "starts by" stays true, and the reason changes rarely."""
    seconds = at.second + at.microsecond / 1e6
    if seconds == 0:
        return at
    return at.replace(second=0, microsecond=0) + timedelta(minutes=1)


def show_time(at: datetime) -> str:
    return by_minute(at).strftime("%Y-%m-%d %H:%M")


def minutes_left(seconds: float) -> int:
    return max(1, math.ceil(seconds / 60))
