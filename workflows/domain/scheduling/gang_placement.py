"""Gang runs within a scheduling pass: the waiting workers of one gang run are decided together.

They are decided at the place of the first of them. Quota is asked for all of them at once ("Gang waits for
namespace quota: ..."); each takes the tightest machine as a single worker would, its checks seeing where the earlier
ones went; if one does not fit, every tentative place is undone and each waits with "Gang cannot be placed whole: r
of n machines ready" and the machines' reasons for the first member that did not fit. With min_available m, the
run's placed workers count, and only the lowest-index waiting ones that bring it to m are placed together ("Cannot
place the minimum to start together: k of m fit at once; r of n machines ready", k counting the placed workers and
the waiting ones that fit with them, so that min_available k would start now); once m is reached the others are
decided one by one, as single workers. A gang that would fit whole on the cluster emptied of other runs' work leads
the queue as a single worker does: it keeps its reason, holds a machine for every member (found one after the other,
the earlier ones held in place) from when the last of them can start, and work behind it backfills only around that;
behind another head it is "Queued behind ...". Before holding room, a gang head preempts strictly lower-priority work
when that lets every member it needs (with min_available, the minimum) start at once: members are placed tentatively
one after the other, each on a machine free now, else where stopping the least work lets it start
(`preemption.choose_gang_victims`), and the gang must then fit whole as the next pass will place it; each waiting
member says "Preempting k lower-priority worker(s) of <runs> to start". While the victims stop, the gang keeps room
for all those members ("Starting: waiting for k preempted worker(s) to stop"), or, once one of them no longer fits,
for none.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Protocol

from workflows.domain.constraints import Drive
from workflows.domain.reasons import R, Reason
from workflows.domain.requests import Allocation, JobTaskKey, TaskRequest
from workflows.domain.scheduling.explaining import Explainer, NamesKey
from workflows.domain.scheduling.machines import Cluster
from workflows.domain.scheduling.placement import Ask, ask_for, fit_together_empty
from workflows.domain.scheduling.plans import Decision
from workflows.domain.scheduling.preemption import choose_gang_victims
from workflows.domain.scheduling.quotas import Quota, Usage, check_quota
from workflows.domain.scheduling.reservation import Reservation, Reservations, Reserving


class SchedulingPass(Protocol):
    """What a gang needs of the pass it is decided in: its view, its head, and the steps of a single worker."""

    cluster: Cluster
    quotas: Mapping[str, Quota]
    drives: Mapping[str, Drive]
    explainer: Explainer
    reservations: Reservations
    head: TaskRequest | None

    def decide(self, request: TaskRequest) -> Decision: ...
    def usage(self, namespace: str) -> Usage: ...
    def visible(self, quota: Quota | None) -> tuple[list[str], NamesKey]: ...
    def find(self, ask: Ask, names_key: NamesKey) -> str | Decision | None: ...
    def free_for(self, ask: Ask, names_key: NamesKey) -> str | None: ...
    def take(self, request: TaskRequest, node: str) -> None: ...
    def spared(self) -> set[JobTaskKey]: ...
    def preempt(self, head: TaskRequest, victims: list[Allocation]) -> Reason: ...
    def hold(self, reservation: Reservation) -> Reason: ...
    def behind(self, request: TaskRequest) -> Reason: ...


class GangPlacer:
    """Decides gang runs for one pass, through that pass's view and single-worker steps."""

    def __init__(self, pass_: SchedulingPass) -> None:
        self.pass_ = pass_
        self._fit_cache: dict[tuple[object, ...], bool] = {}  # gang shapes -> whether they fit whole when idle

    def decide(self, members: list[TaskRequest]) -> list[Decision]:
        """A gang run's waiting workers, together. Those it needs (all of them; with min_available the lowest-index
        ones that bring its placed workers up to the minimum) are placed all or none; once the minimum is met, the
        others are decided one by one, as single workers."""
        placed = self.pass_.cluster.placed_count(members[0].job_id)
        required = required_members(members, placed)
        rest = members[len(required) :]
        decisions: list[Decision] = []
        if required:
            together = self._place_together(required, placed)
            if isinstance(together, Decision):  # none is placed: every waiting member says why
                return [replace(together, request=member) for member in members]
            decisions = [Decision(member, node) for member, node in zip(required, together, strict=True)]
        return decisions + [self.pass_.decide(member) for member in rest]

    def promise(self, required: list[TaskRequest], victims: list[Allocation]) -> list[tuple[TaskRequest, str]] | None:
        """Where the members the gang needs go once its victims are gone; None when one no longer fits there, or
        when they all fit now anyway (then they are placed as usual)."""
        _, names_key = self.pass_.visible(self.pass_.quotas.get(required[0].namespace))
        if self._fit_without(required, [], names_key) is not None:
            return None
        nodes = self._fit_without(required, victims, names_key)
        return None if nodes is None else list(zip(required, nodes, strict=True))

    def _place_together(self, required: list[TaskRequest], placed: int) -> list[str] | Decision:
        """A machine for each of `required` (each member's checks see where the earlier ones went), or, undoing
        every tentative place, why they wait (as `required[0]`'s decision). Quota is asked for all at once."""
        pass_, cluster = self.pass_, self.pass_.cluster
        first = required[0]
        quota = pass_.quotas.get(first.namespace)
        asked = Usage()
        for member in required:
            asked.add(member)
        wait = check_quota(quota, pass_.usage(first.namespace), asked, gang=True)
        if wait is not None:
            return Decision(first, None, wait.reason, reached=wait.reached)
        names, names_key = pass_.visible(quota)
        on_one = self._on_one_fabric(required, names, names_key)
        if on_one is not None:
            for member in required:
                pass_.usage(first.namespace).add(member)
            return on_one
        mark = cluster.mark()
        nodes: list[str] = []
        for member in required:
            limit = member.max_parallel
            if limit is not None and cluster.group_placed[(member.job_id, member.group)] >= limit:
                cluster.rollback(mark)
                return Decision(first, None, R.ArrayMaxParallel(k=limit))
            ask = ask_for(member, cluster, pass_.drives)
            found = pass_.find(ask, names_key)
            if not isinstance(found, str):
                # Explained while the earlier members still hold their tentative places: those are why it waits.
                why = found if found is not None else self._apart(ask, names, names_key, placed + len(nodes))
                cluster.rollback(mark)
                return self._gang_waits(required, why, names, names_key)
            cluster.place(member, found)
            nodes.append(found)
        for member in required:
            pass_.usage(first.namespace).add(member)
        return nodes

    def _on_one_fabric(self, required: list[TaskRequest], names: list[str], names_key: NamesKey) -> list[str] | None:
        """A gang that asks for InfiniBand, none of it placed yet, tries each fabric in turn (by name), its members
        asking for that fabric: taking the tightest machine first could leave a fabric too small for the rest, while
        another fabric has room for all. The places on the first fabric that takes them all; None when none does
        (the members are then tried as usual, which explains why they wait)."""
        pass_, cluster = self.pass_, self.pass_.cluster
        network = required[0].network
        if network is None or not network.infiniband or network.fabric or cluster.fabrics_of(required[0].job_id):
            return None
        fabrics = sorted({f for n in names if (f := cluster.machines[n].fabric) is not None})
        if len(fabrics) < 2:
            return None
        for fabric in fabrics:
            pinned = network.model_copy(update={"fabric": fabric})
            mark = cluster.mark()
            nodes: list[str] = []
            for member in required:
                fields = {name: getattr(member, name) for name in TaskRequest.model_fields}
                ask = ask_for(TaskRequest(**fields | {"network": pinned}), cluster, pass_.drives)
                found = pass_.free_for(ask, names_key)
                if found is None:
                    break
                cluster.place(member, found)
                nodes.append(found)
            if len(nodes) == len(required):
                return nodes
            cluster.rollback(mark)
        return None

    def _apart(self, ask: Ask, names: list[str], names_key: NamesKey, fit: int) -> Decision:
        """Why the gang cannot be placed whole, with the machines' reasons for its first member that did not fit;
        `fit`: its workers placed or fitting before that one."""
        request, explainer = ask.request, self.pass_.explainer
        if not names:
            reason = R.NoMachinesRegistered(reason=_apart_reason(request, fit, 0, 0).text)
            return Decision(request, None, reason)
        reasons = explainer.reasons(ask, names, names_key)
        data = explainer.only_data_location(ask, reasons)
        if data is not None:
            return Decision(request, None, R.ChooseDataLocation(node=data), reasons)
        ready = explainer.ready(names, names_key)
        return Decision(request, None, _apart_reason(request, fit, ready, len(names)), reasons)

    def _gang_waits(
        self, required: list[TaskRequest], why: Decision, names: list[str], names_key: NamesKey
    ) -> Decision:
        """A gang that would fit whole once work ends leads the queue (holding room for every member) or queues
        behind its head, as a single worker does; one that never would keeps its reason."""
        first, head = required[0], self.pass_.head
        assert why.reason is not None
        if why.reason.code not in (R.GangCannotBePlaced.code, R.CannotPlaceMinimum.code):
            return why
        if not self._fit_together(required, names, names_key):
            return why
        if head is None or head.job_id == first.job_id:
            preempting = self._preempt_together(required, names, names_key)
            if preempting is not None:
                return Decision(first, None, preempting, why.nodes)
            self._hold_together(required, names)
            return why
        return Decision(first, None, self.pass_.behind(first), why.nodes)

    def _preempt_together(self, required: list[TaskRequest], names: list[str], names_key: NamesKey) -> Reason | None:
        """The head gang stops lower-priority work when that lets every member it needs start at once (victims
        chosen by `choose_gang_victims`); the gang is then placed again as the next pass will once the victims are
        gone, keeping only the victims on machines it uses. None (nothing preempted) when a member would still not
        fit."""
        pass_, cluster = self.pass_, self.pass_.cluster
        first = required[0]
        victims = choose_gang_victims(
            cluster,
            required,
            lambda member: ask_for(member, cluster, pass_.drives),
            lambda ask: pass_.free_for(ask, names_key),
            names,
            pass_.spared(),
        )
        if not victims or (nodes := self._fit_without(required, victims, names_key)) is None:
            return None
        used = set(nodes)
        needed = [v for v in victims if v.node in used]
        if len(needed) < len(victims) and (fewer := self._fit_without(required, needed, names_key)) is not None:
            victims, nodes = needed, fewer
        pass_.head = pass_.head or first
        for member, node in zip(required, nodes, strict=True):
            pass_.take(member, node)  # on top of the victims until they are gone: nothing else fits there
        return pass_.preempt(first, victims)

    def _fit_without(self, required: list[TaskRequest], victims: list[Allocation], names_key: NamesKey) -> (
        list[str] | None
    ):  # fmt: skip
        """Where the members would go, one after the other, were `victims` gone (as a pass places a gang); None
        when one would not fit. Changes nothing."""
        pass_, cluster = self.pass_, self.pass_.cluster
        mark = cluster.mark()
        for victim in victims:
            cluster.lift(victim)
        nodes: list[str] = []
        for member in required:
            node = pass_.free_for(ask_for(member, cluster, pass_.drives), names_key)
            if node is None:
                break
            cluster.place(member, node)
            nodes.append(node)
        cluster.rollback(mark)
        return nodes if len(nodes) == len(required) else None

    def _fit_together(self, required: list[TaskRequest], names: list[str], names_key: NamesKey) -> bool:
        """Whether the members would fit whole on the cluster emptied of other runs' work; remembered for the pass
        by the members' shapes when where the run already is cannot matter."""
        cluster, drives = self.pass_.cluster, self.pass_.drives
        if not all(self.pass_.explainer.feasible(ask_for(m, cluster, drives), names, names_key) for m in required):
            return False
        alone = not any(m.with_run for m in required) and not cluster.placed_count(required[0].job_id)
        key = (tuple(m.shape for m in required), names_key)
        if alone and key in self._fit_cache:
            return self._fit_cache[key]
        fit = fit_together_empty(cluster, required, names, drives)
        if alone:
            self._fit_cache[key] = fit
        return fit

    def _hold_together(self, required: list[TaskRequest], names: list[str]) -> None:
        """The head gang holds a machine for each member, found one after the other with the earlier members held
        in place; all start together, when the last of them can."""
        pass_, cluster = self.pass_, self.pass_.cluster
        pass_.head = pass_.head or required[0]
        mark = cluster.mark()
        found: list[Reservation] = []
        reserving = Reserving(cluster, names, pass_.reservations.nodes)
        for member in required:
            ask = ask_for(member, cluster, pass_.drives)
            reservation = reserving.reserve(ask)
            if reservation is not None:
                found.append(reservation)
                cluster.place(member, reservation.node, until_released=True)
        cluster.rollback(mark)
        starts = [r.at for r in found if r.at is not None]
        at = max(starts) if found and len(starts) == len(found) else None
        for reservation in found:
            pass_.hold(replace(reservation, at=at))


def required_members(members: list[TaskRequest], placed: int) -> list[TaskRequest]:
    """The waiting members a gang run needs placed together: all of them; with min_available, the lowest-index
    ones that bring its `placed` workers up to the minimum (none once it is met)."""
    minimum = members[0].min_available
    return members if minimum is None else members[: max(minimum - placed, 0)]


def _apart_reason(request: TaskRequest, fit: int, ready: int, total: int) -> Reason:
    """ "Gang cannot be placed whole: r of n machines ready"; with min_available, "Cannot place the minimum to start
    together: k of m fit at once; r of n machines ready", k counting the run's placed workers and the lowest-index
    waiting ones that fit with them (so min_available k would start now)."""
    if request.min_available is None:
        return R.GangCannotBePlaced(ready=ready, total=total)
    why = f"{fit} of {request.min_available} fit at once; {ready} of {total} machines ready"
    return R.CannotPlaceMinimum(why=why)
