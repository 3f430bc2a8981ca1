"""One scheduling pass: every waiting worker, in queue order, gets a machine or the reason it waits.

Queue order is higher priority first, then earlier claim. In order, each worker: waits on its namespace's quota
(never blocking other namespaces) or its array's limit; else takes the tightest machine that fits it and that no
head holds (or that it may backfill); else, if no machine could ever take it, says why machine by machine; else the
first such worker of the queue is the head: it preempts lower-priority work when that makes room, or reserves the
machine where it starts soonest; the others queue behind it. The waiting workers of a gang run are decided together,
at the place of the first of them (`gang_placement`). Pure: the result is a Plan the service carries out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import NamedTuple, TypeVar

from workflows.domain.constraints import Drive
from workflows.domain.inventory import NodeView
from workflows.domain.scheduling import gang_placement
from workflows.domain.scheduling.explaining import Explainer, NamesKey
from workflows.domain.scheduling.machines import Cluster, Compiled
from workflows.domain.scheduling.placement import Ask, ask_for, fill, fits
from workflows.domain.scheduling.plans import Decision, Plan, Preemption

__all__ = ["Decision", "JobTaskKey", "Plan", "Preemption", "queue_order", "schedule", "shown_to"]
from workflows.domain.reasons import ANOTHER_NAMESPACE, R, Reason, error_text
from workflows.domain.requests import Allocation, JobTaskKey, TaskRequest, namespace_of, run_name
from workflows.domain.scheduling.preemption import choose_victims, freed
from workflows.domain.scheduling.quotas import Quota, Usage, check_quota, usage_by_namespace
from workflows.domain.scheduling.reservation import Reservation, Reservations, minutes_left, reserve, show_time

_A = TypeVar("_A")


def queue_order(request: TaskRequest) -> tuple[int, datetime, str, int]:
    """Higher priority first, then earlier claim; ties by run and worker for a stable order."""
    return (-request.priority, request.submitted_at, request.job_id, request.index)


def shown_to(job_id: str, namespace: str) -> str:
    """How a reason read in `namespace` names the run `job_id`: its name, or not at all."""
    return run_name(job_id) if namespace_of(job_id) == namespace else ANOTHER_NAMESPACE


def schedule(
    requests: Sequence[TaskRequest],
    nodes: Sequence[NodeView],
    allocations: Iterable[Allocation],
    now: datetime,
    *,
    quotas: Mapping[str, Quota] | None = None,
    drives: Mapping[str, Drive] | None = None,
    preempting: Mapping[JobTaskKey, JobTaskKey] | None = None,
    compiled: Compiled | None = None,
) -> Plan:
    """Decide for every waiting worker. `preempting` maps each worker already asked to stop (victim) to the head
    worker it makes room for; those heads keep the room their victims free. `compiled` keeps the machines compiled
    from one pass to the next."""
    passing = _Pass(nodes, list(allocations), now, quotas or {}, drives or {}, dict(preempting or {}), compiled)
    return passing.run(requests)


class _Pass:
    """One pass's view and decisions. Its public attributes and methods are what gang runs use of it
    (`gang_placement.SchedulingPass`)."""

    def __init__(
        self,
        nodes: Sequence[NodeView],
        allocations: list[Allocation],
        now: datetime,
        quotas: Mapping[str, Quota],
        drives: Mapping[str, Drive],
        preempting: dict[JobTaskKey, JobTaskKey],
        compiled: Compiled | None = None,
    ) -> None:
        self.now = now
        self.cluster = Cluster(nodes, allocations, now, compiled)
        self.quotas = quotas
        self.drives = drives
        self.preempting = preempting
        self.kept: set[JobTaskKey] = set()  # heads keeping their victims' room: waiting, so never victims themselves
        # What each namespace with a quota holds: no other namespace's usage is read (its quota check passes), and
        # summing every allocation at every pass was half of a pass in a burst (bench/README.md).
        self._used = usage_by_namespace(a for a in allocations if a.namespace in quotas) if quotas else {}
        self.explainer = Explainer(self.cluster)
        self.reservations = Reservations()
        self.head: TaskRequest | None = None
        self.head_starts: list[datetime | None] = []
        self.plan = Plan()
        self.gangs = gang_placement.GangPlacer(self)

    # ---- the pass ---------------------------------------------------------------------------------------------

    def run(self, requests: Sequence[TaskRequest]) -> Plan:
        waiting = {r.key: r for r in requests}
        promised = self._keep_promises(waiting)
        gangs: dict[str, list[TaskRequest]] = {}
        for request in sorted(waiting.values(), key=queue_order):
            if request.gang and request.key not in promised:
                gangs.setdefault(request.job_id, []).append(request)
        for request in sorted(waiting.values(), key=queue_order):
            if request.key in promised:
                continue
            if not request.gang:
                self.plan.decisions.extend(self._guarded([request], self._single, request))
            elif (members := gangs.pop(request.job_id, None)) is not None:  # at its first member's place
                self.plan.decisions.extend(self._guarded(members, self.gangs.decide, members))
        return self.plan

    def _single(self, request: TaskRequest) -> list[Decision]:
        return [self.decide(request)]

    def _guarded(
        self, requests: list[TaskRequest], decide: Callable[[_A], list[Decision]], argument: _A
    ) -> list[Decision]:
        """`decide(argument)`, for `requests`; should it raise, whatever it began is undone and each request is set
        aside ("Cannot be scheduled: <error>"), so that one bad request never stops the pass for everyone else."""
        savepoint = _Savepoint.of(self, requests[0].namespace)
        try:
            return decide(argument)
        except Exception as error:
            savepoint.restore(self)
            reason = R.CannotBeScheduled(error=error_text(error))
            return [Decision(request, None, reason) for request in requests]

    def _keep_promises(self, waiting: dict[JobTaskKey, TaskRequest]) -> set[JobTaskKey]:
        """Heads whose victims are still stopping keep the room those victims free ("Starting: waiting for k
        preempted worker(s) to stop"); a head that no longer fits there queues as any other worker. A gang keeps
        room for every member it needs, or, when one of them no longer fits, for none."""
        victims: dict[JobTaskKey, list[Allocation]] = {}
        for victim, head in self.preempting.items():
            alloc = self.cluster.allocations.get(victim)
            if alloc is not None and head in waiting:
                victims.setdefault(head, []).append(alloc)
        promised: set[JobTaskKey] = set()
        for head in sorted(victims, key=lambda key: queue_order(waiting[key])):
            if head in promised:
                continue  # a gang already kept with all its victims
            request = waiting[head]
            members = [r for r in waiting.values() if r.job_id == request.job_id] if request.gang else [request]
            kept = self._guarded(members, self._keep_promise, _Promise(request, waiting, victims))
            for decision in kept:
                promised.add(decision.request.key)
                self.plan.decisions.append(decision)
        return promised

    def _keep_promise(self, head: _Promise) -> list[Decision]:
        """One head (a gang: the members it needs) keeping its victims' room; no decision when it no longer fits."""
        request, waiting, victims = head
        allocs = victims[request.key]
        members = [request]
        required: list[TaskRequest] = []
        if request.gang:
            members = sorted((r for r in waiting.values() if r.job_id == request.job_id), key=queue_order)
            # Once a gang's minimum runs, its members beyond it preempt as single workers do.
            required = gang_placement.required_members(members, self.cluster.placed_count(request.job_id))
        if required:
            allocs = [a for h, found in victims.items() if h[0] == request.job_id for a in found]
            places = self.gangs.promise(required, allocs)
        else:
            members, places = [request], self._single_promise(request, allocs)
        if places is None:
            return []
        # The victims hold their room until they are gone; the head takes the rest now, so nothing else does.
        for member, node in places:
            self.take(member, node)
            self.kept.add(member.key)
        self.head = self.head or request
        return [Decision(member, None, R.WaitingForPreempted(k=len(allocs))) for member in members]

    def _single_promise(self, request: TaskRequest, victims: list[Allocation]) -> list[tuple[TaskRequest, str]] | None:
        node = victims[0].node
        machine = self.cluster.machines.get(node)
        ask = ask_for(request, self.cluster, self.drives)
        if machine is None or not fits(machine, freed(self.cluster.free[node], victims), ask):
            return None
        return [(request, node)]

    def take(self, request: TaskRequest, node: str) -> None:
        self.cluster.place(request, node)
        self.usage(request.namespace).add(request)

    def usage(self, namespace: str) -> Usage:
        """What `namespace` holds, this pass's placements included; counted from the allocations only for a
        namespace with a quota (for another, only what this pass placed: nothing reads it)."""
        return self._used.setdefault(namespace, Usage())

    def decide(self, request: TaskRequest) -> Decision:
        """One worker on its own (a gang's members beyond its minimum are decided so too)."""
        quota = self.quotas.get(request.namespace)
        wait = check_quota(quota, self.usage(request.namespace), _asked(request))
        if wait is not None:
            return Decision(request, None, wait.reason, reached=wait.reached)
        limit = request.max_parallel
        if limit is not None and self.cluster.group_placed[(request.job_id, request.group)] >= limit:
            return Decision(request, None, R.ArrayMaxParallel(k=limit))
        names, names_key = self.visible(quota)
        ask = ask_for(request, self.cluster, self.drives)
        found = self.find(ask, names_key)
        if isinstance(found, Decision):
            return found
        if found is not None:
            self.take(request, found)
            return Decision(request, found)
        return self._blocked(ask, names, names_key)

    # ---- finding a machine ------------------------------------------------------------------------------------

    def visible(self, quota: Quota | None) -> tuple[list[str], NamesKey]:
        """The machines a namespace may use: those of its pools, or all."""
        if quota is None or not quota.pools:
            return self.cluster.names, None
        pools = set(quota.pools)
        return [n for n in self.cluster.names if self.cluster.machines[n].pools & pools], quota.pools

    def _allowed(self, ask: Ask, names_key: NamesKey) -> Iterator[str]:
        """The machines that take the worker now, tightest first."""
        cluster = self.cluster
        pools = set(names_key) if names_key is not None else None
        # Holds first: remembered per size of worker, they turn a gang head's many machines away at a set lookup.
        refused = self.reservations.refusing(cluster, ask)
        for name in cluster.candidates(ask.request):
            if name in refused:
                continue
            machine = cluster.machines[name]
            if (pools is None or machine.pools & pools) and fits(machine, cluster.free[name], ask):
                yield name

    def free_for(self, ask: Ask, names_key: NamesKey) -> str | None:
        """The tightest machine that takes the worker now, patience aside."""
        return next(self._allowed(ask, names_key), None)

    def find(self, ask: Ask, names_key: NamesKey) -> str | Decision | None:
        """The tightest machine that takes the worker now; with a patience window, one on an InfiniBand fabric
        (its run's, if it has one) while the window lasts."""
        request = ask.request
        candidates = self._allowed(ask, names_key)
        patience = request.topology.patience_seconds if request.topology else None
        if not patience:
            return next(candidates, None)
        fabrics = {m.fabric for n in ask.run_nodes if (m := self.cluster.machines.get(n)) and m.fabric}
        allowed = list(candidates)
        for name in allowed:
            fabric = self.cluster.machines[name].fabric
            if fabric is not None and (not fabrics or fabric in fabrics):
                return name
        left = patience - (self.now - request.since).total_seconds()
        fabric = min(fabrics) if fabrics else self.explainer.fabric_for(ask, names_key)
        if left <= 0 or not allowed or fabric is None:
            return allowed[0] if allowed else None
        self._wake(self.now + timedelta(seconds=left % 60 or 60))
        return Decision(request, None, R.WaitingForFabric(minutes=minutes_left(left), fabric=fabric))

    def _wake(self, at: datetime) -> None:
        if self.plan.wake_at is None or at < self.plan.wake_at:
            self.plan.wake_at = at

    # ---- waiting ----------------------------------------------------------------------------------------------

    def _blocked(self, ask: Ask, names: list[str], names_key: NamesKey) -> Decision:
        request = ask.request
        if not names:
            nothing = R.NoMachineFits(ready=0, total=0)
            return Decision(request, None, R.NoMachinesRegistered(reason=nothing.text))
        reasons = self.explainer.reasons(ask, names, names_key)
        data = self.explainer.only_data_location(ask, reasons)
        if data is not None:
            return Decision(request, None, R.ChooseDataLocation(node=data), reasons)
        if not self.explainer.feasible(ask, names, names_key):
            ready = self.explainer.ready(names, names_key)
            return Decision(request, None, R.NoMachineFits(ready=ready, total=len(names)), reasons)
        if self.head is None or self.head.job_id == request.job_id:
            return Decision(request, None, self._lead(ask, names), reasons)
        return Decision(request, None, self.behind(request), reasons)

    def _lead(self, ask: Ask, names: list[str]) -> Reason:
        """The head: stop lower-priority work if that lets it start, else hold the machine where it starts first."""
        request = ask.request
        self.head = self.head or request
        choice = choose_victims(self.cluster, ask, names, spared=self.spared())
        if choice is not None:
            self.take(request, choice.node)  # on top of its victims until they are gone: nothing else fits there
            return self.preempt(request, list(choice.victims))
        reservation = reserve(self.cluster, ask, names, self.reservations.nodes)
        assert reservation is not None, "a feasible worker has a machine to wait for"
        return self.hold(reservation)

    def spared(self) -> set[JobTaskKey]:
        """Workers that are not to be preempted: those already stopping, and heads keeping room (not running)."""
        return set(self.preempting) | self.kept

    def preempt(self, head: TaskRequest, victims: list[Allocation]) -> Reason:
        """Ask the victims to stop, one entry per victim run, each naming the head's run as that run's namespace
        sees it; the victims are remembered as making room for `head` (a gang's first member stands for it)."""
        by_run: dict[str, list[str]] = {}
        for victim in victims:
            self.preempting[victim.key] = head.key
            by_run.setdefault(victim.job_id, []).append(victim.task_id)
        for job_id, task_ids in sorted(by_run.items()):
            by = shown_to(head.job_id, namespace_of(job_id))
            self.plan.preemptions.append(Preemption(job_id, tuple(sorted(task_ids)), by, head.key))
        runs = sorted({shown_to(job_id, head.namespace) for job_id in by_run})
        return R.Preempting(k=len(victims), runs=", ".join(runs))

    def hold(self, reservation: Reservation) -> Reason:
        self.reservations.add(reservation)
        if reservation.at is None:  # nothing may start there now: no need to look at it again
            self.cluster.close(reservation.node)
        self.head_starts.append(reservation.at)
        self.plan.holds[reservation.request.key] = (reservation.node, reservation.at)
        priority = reservation.request.priority
        if reservation.at is None:
            return R.NextToRunWaits(priority=priority)
        return R.NextToRunStartsBy(priority=priority, time=show_time(reservation.at))

    def behind(self, request: TaskRequest) -> Reason:
        head = self.head
        assert head is not None
        who = shown_to(head.job_id, request.namespace)
        if head.priority > request.priority:
            return fill(R.QueuedBehindHigherPriority, run=who)
        starts = self.head_starts
        if starts and None not in starts:
            return fill(R.QueuedBehindStartsBy, run=who, time=show_time(max(s for s in starts if s is not None)))
        return fill(R.QueuedBehind, run=who)


class _Promise(NamedTuple):
    """A head whose victims are still stopping, with what the pass knows of every waiting worker and victim."""

    request: TaskRequest
    waiting: dict[JobTaskKey, TaskRequest]
    victims: dict[JobTaskKey, list[Allocation]]


@dataclass(frozen=True)
class _Savepoint:
    """What one decision may change in a pass, to be undone should the decision raise. The plan's holds and the
    victims being stopped only gain new keys during a decision, so their lengths mark them. A machine a decision
    closed stays closed for the rest of the pass: that keeps others off it, never puts two workers on one GPU."""

    placed: int
    reserved: int
    preemptions: int
    holds: int
    preempting: int
    kept: frozenset[JobTaskKey]
    head: TaskRequest | None
    head_starts: int
    wake_at: datetime | None
    namespace: str
    usage: Usage

    @classmethod
    def of(cls, pass_: _Pass, namespace: str) -> _Savepoint:
        plan = pass_.plan
        return cls(
            pass_.cluster.mark(),
            pass_.reservations.mark(),
            len(plan.preemptions),
            len(plan.holds),
            len(pass_.preempting),
            frozenset(pass_.kept),
            pass_.head,
            len(pass_.head_starts),
            plan.wake_at,
            namespace,
            replace(pass_.usage(namespace)),
        )

    def restore(self, pass_: _Pass) -> None:
        plan = pass_.plan
        pass_.cluster.rollback(self.placed)
        pass_.reservations.rollback(self.reserved)
        del plan.preemptions[self.preemptions :]
        for key in list(plan.holds)[self.holds :]:
            del plan.holds[key]
        for key in list(pass_.preempting)[self.preempting :]:
            del pass_.preempting[key]
        pass_.kept.intersection_update(self.kept)
        pass_.head = self.head
        del pass_.head_starts[self.head_starts :]
        plan.wake_at = self.wake_at
        used = pass_.usage(self.namespace)
        used.gpus, used.cpu, used.memory_bytes = self.usage.gpus, self.usage.cpu, self.usage.memory_bytes


def _asked(request: TaskRequest) -> Usage:
    return Usage(gpus=request.gpus, cpu=request.cpu, memory_bytes=request.memory_bytes)
