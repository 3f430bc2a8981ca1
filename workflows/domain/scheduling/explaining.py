"""Every machine's reasons for a waiting worker, computed once per shape of request and kept up to date as the
pass places workers: thousands of waiting workers usually come in a few shapes, and a placement changes one
machine. Also whether a worker could ever fit (the same machines, ignoring what is held now)."""

from __future__ import annotations

from dataclasses import dataclass

from workflows.domain.reasons import NodeReasons, R, Reason
from workflows.domain.scheduling.machines import Cluster
from workflows.domain.scheduling.placement import Ask, explain, fits_empty, where

# Which machines a namespace sees: None (all), or its pools.
NamesKey = tuple[str, ...] | None


@dataclass
class _Reasons:
    version: int
    nodes: list[NodeReasons]
    position: dict[str, int]


class Explainer:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self._reasons: dict[tuple[object, ...], _Reasons] = {}
        self._feasible: dict[tuple[object, ...], bool] = {}
        self._fabric: dict[tuple[object, ...], str | None] = {}
        self._ready: dict[NamesKey, int] = {}
        self._profiles: dict[tuple[object, ...], int] = {}
        self._profile_of: dict[str, int] = {}  # each machine's profile, interned when first asked
        self._said: dict[tuple[object, ...], list[Reason]] = {}

    def _profile(self, name: str) -> int:
        interned = self._profile_of.get(name)
        if interned is None:
            profile = self.cluster.machines[name].profile
            interned = self._profile_of[name] = self._profiles.setdefault(profile, len(self._profiles))
        return interned

    @staticmethod
    def _key(ask: Ask, names_key: NamesKey) -> tuple[object, ...]:
        run = where(ask) if ask.request.with_run else ()
        return (ask.request.shape, run, names_key)

    def _one(self, name: str, ask: Ask, shape: tuple[object, ...] | None) -> NodeReasons:
        """One machine's reasons; machines alike (same profile, same free room) share them when the worker's
        reasons cannot depend on a machine's name (`shape` is then its cache key)."""
        machine, free = self.cluster.machines[name], self.cluster.free[name]
        if shape is None:
            reasons = explain(machine, free, ask)
        else:
            key = (shape, self._profile(name), free.cpu, free.memory_bytes, free.gpus)
            reasons = self._said.get(key)  # type: ignore[assignment]
            if reasons is None:
                reasons = self._said[key] = explain(machine, free, ask)
        return NodeReasons.model_construct(name=name, reasons=reasons)

    @staticmethod
    def _shared(ask: Ask) -> tuple[object, ...] | None:
        request = ask.request
        by_name = request.with_run or request.drives or (request.selection and request.selection.names)
        return None if by_name else request.shape

    def reasons(self, ask: Ask, names: list[str], names_key: NamesKey) -> list[NodeReasons]:
        """Each machine's reasons, in name order. The list returned is never changed afterwards."""
        key = self._key(ask, names_key)
        known = self._reasons.get(key)
        version = self.cluster.version
        if known is not None and known.version == version:
            return known.nodes
        shared = self._shared(ask)
        if known is None:
            nodes = [self._one(name, ask, shared) for name in names]
            known = _Reasons(version, nodes, {name: i for i, name in enumerate(names)})
        else:
            nodes = list(known.nodes)
            for name in self.cluster.changed_since(known.version):
                i = known.position.get(name)
                if i is not None:
                    nodes[i] = self._one(name, ask, shared)
            known = _Reasons(version, nodes, known.position)
        self._reasons[key] = known
        return nodes

    def only_data_location(self, ask: Ask, nodes: list[NodeReasons]) -> str | None:
        """The first machine that lacks nothing but a data location for the worker's drives."""
        if not ask.request.drives:
            return None
        for node in nodes:
            if len(node.reasons) == 1 and node.reasons[0].code == R.ChooseDataLocation.code:
                return node.name
        return None

    def feasible(self, ask: Ask, names: list[str], names_key: NamesKey) -> bool:
        """Whether some machine would take the worker once the work it holds ended."""
        key = self._key(ask, names_key)
        known = self._feasible.get(key)
        if known is None:
            machines = self.cluster.machines
            known = self._feasible[key] = any(fits_empty(machines[n], ask) for n in names)
        return known

    def fabric_for(self, ask: Ask, names_key: NamesKey) -> str | None:
        """The InfiniBand fabric worth waiting for: that of the first machine on one that could take the worker."""
        key = self._key(ask, names_key)
        if key not in self._fabric:
            pools = set(names_key or ())
            fabric = None
            for machine in self.cluster.machines.values():
                if machine.fabric and (not pools or machine.pools & pools) and fits_empty(machine, ask):
                    fabric = machine.fabric
                    break
            self._fabric[key] = fabric
        return self._fabric[key]

    def ready(self, names: list[str], names_key: NamesKey) -> int:
        if names_key not in self._ready:
            self._ready[names_key] = sum(self.cluster.machines[n].not_ready is None for n in names)
        return self._ready[names_key]
