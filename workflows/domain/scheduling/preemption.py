"""Preemption: which lower-priority workers to stop so that the head of the queue starts, losing as little work
as possible, and never for a worker (or gang) that still would not fit.

A victim that is a gang member stops its whole gang (the run's side does that); the choice here counts only the
room and the work of the workers it names, conservatively: the rest of such a gang is neither counted as freed nor
as lost."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.scheduling.machines import Cluster, CompiledNode, Free
from workflows.domain.scheduling.placement import Ask, ask_key, check_cpu, check_gpus, check_memory, fits, fits_empty

# Up to this many candidates on one machine every subset is tried; beyond, a greedy choice trimmed to a minimum.
EXACT_UP_TO = 8

Cost = tuple[float, float, int, int]


@dataclass(frozen=True)
class VictimChoice:
    node: str
    victims: tuple[Allocation, ...]
    cost: Cost


def work_lost(alloc: Allocation, cluster: Cluster) -> tuple[float, float]:
    """GPU-seconds and CPU-seconds it has run (a preempted worker starts over)."""
    started = alloc.started_at or cluster.now
    seconds = max((cluster.now - started).total_seconds(), 0.0)
    return alloc.gpus * seconds, alloc.cpu * seconds


def cost_of(victims: Iterable[Allocation], cluster: Cluster) -> Cost:
    """Work lost first (GPU-seconds, then CPU-seconds), then fewer victims, then lower priorities."""
    gpu = cpu = 0.0
    count, top = 0, -1
    for alloc in victims:
        g, c = work_lost(alloc, cluster)
        gpu, cpu, count, top = gpu + g, cpu + c, count + 1, max(top, alloc.priority)
    return (gpu, cpu, count, top)


def _room_fits(machine: CompiledNode, free: Free, ask: Ask) -> bool:
    return not (check_cpu(machine, free, ask) or check_memory(machine, free, ask) or check_gpus(machine, free, ask))


def freed(free: Free, victims: Iterable[Allocation]) -> Free:
    """What is free once `victims` are gone."""
    result = Free(free.cpu, free.memory_bytes, free.gpus)
    for alloc in victims:
        result.cpu += alloc.cpu
        result.memory_bytes += alloc.memory_bytes
        result.gpus += alloc.gpus
    return result


def _cheapest(machine: CompiledNode, free: Free, ask: Ask, candidates: Sequence[Allocation], cluster: Cluster) -> (
    tuple[Allocation, ...] | None
):  # fmt: skip
    if len(candidates) <= EXACT_UP_TO:
        best: tuple[Cost, tuple[Allocation, ...]] | None = None
        for size in range(1, len(candidates) + 1):
            for subset in combinations(candidates, size):
                if _room_fits(machine, freed(free, subset), ask):
                    cost = cost_of(subset, cluster)
                    if best is None or cost < best[0]:
                        best = (cost, subset)
        return best[1] if best else None
    # Greedy: cheapest first until it fits, then drop any victim it fits without (most expensive first).
    chosen: list[Allocation] = []
    for alloc in sorted(candidates, key=lambda a: (cost_of([a], cluster), a.key)):
        chosen.append(alloc)
        if _room_fits(machine, freed(free, chosen), ask):
            break
    else:
        return None
    for alloc in sorted(chosen, key=lambda a: (cost_of([a], cluster), a.key), reverse=True):
        rest = [a for a in chosen if a is not alloc]
        if _room_fits(machine, freed(free, rest), ask):
            chosen = rest
    return tuple(chosen)


def choose_victims(cluster: Cluster, ask: Ask, names: Iterable[str], spared: set[tuple[str, str]]) -> (
    VictimChoice | None
):  # fmt: skip
    """The machine and the lower-priority workers on it whose stopping lets the worker start there, losing the
    least work; None when no such set exists (then nothing is preempted). `spared`: workers already stopping.
    Each machine's answer is remembered until its room changes: a gang head asks again for every member."""
    frozen = frozenset(spared)
    best: VictimChoice | None = None
    for name in names:
        key = ("victims", name, cluster.node_version[name], ask.request.priority, frozen, *ask_key(ask))
        if key not in cluster.memo:
            cluster.memo[key] = _victims_on(cluster, name, ask, frozen)
        choice: VictimChoice | None = cluster.memo[key]  # type: ignore[assignment]
        if choice is not None and (best is None or (choice.cost, choice.node) < (best.cost, best.node)):
            best = choice
    return best


def _victims_on(cluster: Cluster, name: str, ask: Ask, spared: frozenset[tuple[str, str]]) -> VictimChoice | None:
    machine = cluster.machines[name]
    if machine.not_ready is not None or not fits_empty(machine, ask):
        return None
    priority = ask.request.priority
    candidates = sorted(
        (a for a in cluster.held[name].values() if a.priority < priority and a.key not in spared), key=lambda a: a.key
    )
    free = cluster.free[name]
    if not candidates or not _room_fits(machine, freed(free, candidates), ask):
        return None
    victims = _cheapest(machine, free, ask, candidates, cluster)
    if victims is None or not fits(machine, freed(free, victims), ask):
        return None
    return VictimChoice(name, victims, cost_of(victims, cluster))


def choose_gang_victims(
    cluster: Cluster,
    members: Sequence[TaskRequest],
    ask_for: Callable[[TaskRequest], Ask],
    free_for: Callable[[Ask], str | None],
    names: Sequence[str],
    spared: set[tuple[str, str]],
) -> list[Allocation] | None:
    """The lower-priority workers whose stopping lets a gang's members start at once, or None. The members are
    placed tentatively one after the other (`ask_for` sees the earlier ones in place): each on the machine
    `free_for` finds free now (nothing lost), else where `choose_victims` loses the least work for it, its checks
    seeing where the earlier members went and what their victims freed. Changes nothing in the end."""
    mark = cluster.mark()
    victims: list[Allocation] = []
    for member in members:
        ask = ask_for(member)
        node = free_for(ask)
        if node is None:
            choice = choose_victims(cluster, ask, names, spared)
            if choice is None:
                cluster.rollback(mark)
                return None
            for victim in choice.victims:
                cluster.lift(victim)
            victims.extend(choice.victims)
            node = choice.node
        cluster.place(member, node)
    cluster.rollback(mark)
    return victims
