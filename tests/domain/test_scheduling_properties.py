"""Invariants of a pass over random clusters: one decision per worker, no machine over capacity, the head never
delayed by backfill, quota never exceeded, preemption only of lower-priority work and only when it makes room,
the same decisions whatever order the view was rebuilt in, and a gang never partly placed."""

from __future__ import annotations

import random
from collections import defaultdict
from datetime import timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.domain.builders import at, holding, machine, request
from workflows.domain.inventory import NodeState, NodeView
from workflows.domain.requests import Allocation, TaskRequest, allocation_for
from workflows.domain.scheduling.queue import Plan, schedule
from workflows.domain.scheduling.quotas import Quota

NOW = at(30)
NAMES = ["n0", "n1", "n2", "n3", "n4"]
# CPU in quarter cores so that sums are exact in binary floating point.
quarters = st.integers(0, 64).map(lambda q: q / 4)
limits = st.sampled_from([None, None, 600.0, 1800.0, 3600.0, 7200.0])


@st.composite
def clusters(
    draw: st.DrawFn, priorities: int = 3, namespaces: int = 2
) -> tuple[list[TaskRequest], list[NodeView], list[Allocation]]:
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, min_size=1, max_size=5))
    nodes = [
        machine(
            name,
            cpus=draw(quarters),
            memory=draw(st.integers(0, 1000)),
            gpus=draw(st.integers(0, 8)),
            state=draw(st.sampled_from([NodeState.READY, NodeState.READY, NodeState.READY, NodeState.DOWN])),
        )
        for name in names
    ]
    allocations = [
        holding(
            draw(st.sampled_from([*names, "gone"])),
            run=f"held-{i}",
            namespace=f"ns{draw(st.integers(0, namespaces - 1))}",
            task="x-0",
            cpu=draw(quarters),
            memory=draw(st.integers(0, 300)),
            gpus=draw(st.integers(0, 4)),
            priority=draw(st.integers(0, priorities - 1)),
            started=draw(st.integers(0, 1500)),
            limit=draw(limits),
        )
        for i in range(draw(st.integers(0, 8)))
    ]
    requests = [
        request(
            "w-0",
            run=f"r{i}",
            namespace=f"ns{draw(st.integers(0, namespaces - 1))}",
            priority=draw(st.integers(0, priorities - 1)),
            submitted=draw(st.integers(0, 5)),
            cpu=draw(quarters),
            memory=draw(st.integers(0, 300)),
            gpus=draw(st.integers(0, 6)),
            limit=draw(limits),
        )
        for i in range(draw(st.integers(0, 12)))
    ]
    return requests, nodes, allocations


Cluster = tuple[list[TaskRequest], list[NodeView], list[Allocation]]


@st.composite
def with_gangs(draw: st.DrawFn) -> Cluster:
    """A random cluster whose queue also holds gang runs (some with min_available and a member already placed)."""
    requests, nodes, allocations = draw(clusters())
    names = [n.name for n in nodes]
    for j in range(draw(st.integers(1, 3))):
        size = draw(st.integers(1, 4))
        minimum = draw(st.sampled_from([None, None, *range(1, size + 1)]))
        namespace, cpu = f"ns{draw(st.integers(0, 1))}", draw(quarters)
        memory, gpus = draw(st.integers(0, 300)), draw(st.integers(0, 6))
        priority, submitted, limit = draw(st.integers(0, 2)), draw(st.integers(0, 5)), draw(limits)
        first = 0
        if minimum is not None and size > 1 and draw(st.booleans()):
            first = 1  # its first worker already runs
            node = draw(st.sampled_from(names))
            allocations.append(
                holding(
                    node,
                    run=f"g{j}",
                    namespace=namespace,
                    task="w-0",
                    cpu=cpu,
                    memory=memory,
                    gpus=gpus,
                    group="w",
                    priority=priority,
                )
            )
        requests += [
            request(
                f"w-{i}",
                run=f"g{j}",
                namespace=namespace,
                priority=priority,
                submitted=submitted,
                cpu=cpu,
                memory=memory,
                gpus=gpus,
                limit=limit,
                gang=True,
                min_available=minimum,
            )
            for i in range(first, size)
        ]
    return requests, nodes, allocations


@st.composite
def with_senior_gangs(draw: st.DrawFn) -> Cluster:
    """As `with_gangs`, the gang runs raised above much of the running work, so that their heads often preempt."""
    requests, nodes, allocations = draw(with_gangs())
    boost = draw(st.integers(1, 3))
    gangs = {r.job_id for r in requests if r.gang}
    requests = [r.model_copy(update={"priority": r.priority + boost}) if r.gang else r for r in requests]
    allocations = [a.model_copy(update={"priority": a.priority + boost}) if a.job_id in gangs else a
                   for a in allocations]  # fmt: skip
    return requests, nodes, allocations


def _within_capacity(plan: Plan, nodes: list[NodeView], allocations: list[Allocation]) -> None:
    by_name = {n.name: n for n in nodes}
    held: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for a in allocations:
        held[a.node] = [held[a.node][0] + a.cpu, held[a.node][1] + a.memory_bytes, held[a.node][2] + a.gpus]
    added: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for d in plan.decisions:
        if d.node is None:
            assert d.reason is not None
            continue
        assert by_name[d.node].state is NodeState.READY
        added[d.node] = [added[d.node][0] + d.request.cpu, added[d.node][1] + d.request.memory_bytes,
                         added[d.node][2] + d.request.gpus]  # fmt: skip
    for name, (cpu, memory, gpus) in added.items():
        inv = by_name[name].inventory
        assert inv is not None
        assert cpu <= max(inv.cpus - held[name][0], 0) + 1e-9
        assert memory <= max(inv.memory_bytes - held[name][1], 0)
        assert gpus <= max(len(inv.gpus) - held[name][2], 0)


QUOTAS = {"ns0": Quota(namespace="ns0", gpus=6, cpu=8), "ns1": Quota(namespace="ns1", memory_bytes=400)}


def placed(plan: Plan) -> list[Allocation]:
    return [allocation_for(d.request, d.node, NOW) for d in plan.decisions if d.node is not None]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(clusters())
def test_no_machine_is_ever_over_capacity_and_each_worker_gets_one_decision(cluster: Cluster) -> None:
    requests, nodes, allocations = cluster
    plan = schedule(requests, nodes, allocations, NOW, quotas=QUOTAS)
    assert sorted(d.request.key for d in plan.decisions) == sorted(r.key for r in requests)
    _within_capacity(plan, nodes, allocations)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(clusters(priorities=1))
def test_backfill_never_delays_the_head(cluster: Cluster) -> None:
    requests, nodes, allocations = cluster
    plan = schedule(requests, nodes, allocations, NOW)
    order = [d.request.key for d in plan.decisions]
    for key, (node, start) in plan.holds.items():
        head = next(r for r in requests if r.key == key)
        later = [d for d in plan.decisions[order.index(key) + 1 :] if d.node == node]
        if start is None:
            assert later == [], "nothing may start on a machine held for a head without a known start"
            continue
        # Everything the pass placed, then the head alone: it still starts there by its time.
        again = schedule([head], [n for n in nodes if n.name == node], [*allocations, *placed(plan)], NOW)
        decision = again.decisions[0]
        if decision.node is None:
            assert key in again.holds, decision.reason
            new_start = again.holds[key][1]
            assert new_start is not None and new_start <= start


@settings(max_examples=150, deadline=None, derandomize=True)
@given(clusters())
def test_quota_is_never_exceeded(cluster: Cluster) -> None:
    requests, nodes, allocations = cluster
    plan = schedule(requests, nodes, allocations, NOW, quotas=QUOTAS)
    for namespace, quota in QUOTAS.items():
        before = [a for a in allocations if a.namespace == namespace]
        after = [a for a in placed(plan) if a.namespace == namespace]
        for resource in ("gpus", "cpu", "memory_bytes"):
            limit = quota.limit(resource)
            added = sum(getattr(a, resource) for a in after)
            if limit is not None and added:
                assert sum(getattr(a, resource) for a in before) + added <= limit + 1e-9


@settings(max_examples=150, deadline=None, derandomize=True)
@given(clusters(priorities=4))
def test_preemption_stops_only_lower_priority_work_and_only_when_it_makes_room(cluster: Cluster) -> None:
    requests, nodes, allocations = cluster
    plan = schedule(requests, nodes, allocations, NOW)
    by_key = {a.key: a for a in allocations}
    for preemption in plan.preemptions:
        head = next(r for r in requests if r.key == preemption.head)
        victims = [by_key[(preemption.job_id, t)] for t in preemption.task_ids]
        assert all(v.priority < head.priority for v in victims)
        assert preemption.by in (head.run, "(a job in another namespace)")
        assert (preemption.by == head.run) == (preemption.job_id.split("/")[1] == head.namespace)
        decision = plan.decision(head.key)
        assert decision.reason is not None and decision.reason.code == "Preempting"
    for head_key in {p.head for p in plan.preemptions}:
        head = next(r for r in requests if r.key == head_key)
        gone = {(p.job_id, t) for p in plan.preemptions if p.head == head_key for t in p.task_ids}
        node = by_key[next(iter(gone))].node
        # Once its victims are gone, the head fits there.
        rest = [a for a in allocations if a.key not in gone]
        again = schedule([head], [n for n in nodes if n.name == node], rest, NOW)
        assert again.decisions[0].node == node
    victims = [(p.job_id, t) for p in plan.preemptions for t in p.task_ids]
    assert len(victims) == len(set(victims)), "a worker is preempted once"


@settings(max_examples=100, deadline=None, derandomize=True)
@given(clusters(priorities=3), st.randoms(use_true_random=False))
def test_the_same_view_in_any_order_gives_the_same_decisions(cluster: Cluster, rnd: random.Random) -> None:
    requests, nodes, allocations = cluster
    first = schedule(requests, nodes, allocations, NOW, quotas=QUOTAS)
    shuffled = [list(x) for x in (requests, nodes, allocations)]
    for items in shuffled:
        rnd.shuffle(items)
    again = schedule(shuffled[0], shuffled[1], shuffled[2], NOW, quotas=QUOTAS)  # type: ignore[arg-type]
    assert again == first


@settings(max_examples=150, deadline=None, derandomize=True)
@given(with_gangs())
def test_a_gang_is_never_partly_placed_and_its_minimum_starts_together(cluster: Cluster) -> None:
    requests, nodes, allocations = cluster
    plan = schedule(requests, nodes, allocations, NOW, quotas=QUOTAS)
    assert sorted(d.request.key for d in plan.decisions) == sorted(r.key for r in requests)
    _within_capacity(plan, nodes, allocations)
    runs: dict[str, list[tuple[TaskRequest, str | None]]] = defaultdict(list)
    for d in plan.decisions:
        if d.request.gang:
            runs[d.request.job_id].append((d.request, d.node))
    for job_id, members in runs.items():
        minimum = members[0][0].min_available
        placed_now = sum(node is not None for _, node in members)
        if minimum is None:
            assert placed_now in (0, len(members)), f"{job_id} partly placed"
            continue
        # The lowest-index members that reach the minimum start together: none of them, or all of them.
        before = sum(a.job_id == job_id for a in allocations)
        required = sorted(members, key=lambda m: m[0].index)[: max(minimum - before, 0)]
        placed_required = sum(node is not None for _, node in required)
        assert placed_required in (0, len(required)), f"{job_id}: its minimum is partly placed"
        if placed_now:
            assert placed_required == len(required), f"{job_id}: a member beyond the minimum started without it"


@settings(max_examples=150, deadline=None, derandomize=True)
@given(with_gangs())
def test_backfill_never_delays_a_gang_head(cluster: Cluster) -> None:
    requests, nodes, allocations = cluster
    plan = schedule(requests, nodes, allocations, NOW)
    by_key = {r.key: r for r in requests}
    members = [by_key[key] for key in plan.holds if by_key[key].gang and by_key[key].min_available is None]
    if not members:
        return
    order = [d.request.key for d in plan.decisions]
    later = plan.decisions[order.index(members[-1].key) + 1 :]
    starts = {start for _, start in plan.holds.values()}
    assert len(starts) == 1, "a gang's members start together"
    [start] = starts
    held = {node for node, _ in plan.holds.values()}
    if start is None:
        assert not [d for d in later if d.node in held], "nothing starts where a gang waits without a time"
        return
    # Everything the pass placed, then the gang alone on the machines it holds: it still starts by its time.
    again = schedule(members, [n for n in nodes if n.name in held], [*allocations, *placed(plan)], NOW)
    if any(d.node is None for d in again.decisions):
        new_starts = {s for _, s in again.holds.values()}
        assert len(new_starts) == 1 and None not in new_starts and max(new_starts) <= start  # type: ignore[operator]


@settings(max_examples=100, deadline=None, derandomize=True)
@given(with_gangs(), st.randoms(use_true_random=False))
def test_gangs_get_the_same_decisions_in_any_order(cluster: Cluster, rnd: random.Random) -> None:
    requests, nodes, allocations = cluster
    first = schedule(requests, nodes, allocations, NOW, quotas=QUOTAS)
    shuffled = [list(x) for x in (requests, nodes, allocations)]
    for items in shuffled:
        rnd.shuffle(items)
    again = schedule(shuffled[0], shuffled[1], shuffled[2], NOW, quotas=QUOTAS)  # type: ignore[arg-type]
    assert again == first


def test_a_time_limit_is_counted_from_the_start_of_its_worker() -> None:
    alloc = holding("n0", started=60, limit=600)
    assert alloc.ends_at(NOW) == at(11)
    assert holding("n0").ends_at(NOW) is None
    assert allocation_for(request(limit=60), "n0", NOW).ends_at(NOW) == NOW + timedelta(seconds=60)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(with_senior_gangs())
def test_a_gang_head_preempts_only_lower_priority_work_and_then_fits_whole(cluster: Cluster) -> None:
    requests, nodes, allocations = cluster
    plan = schedule(requests, nodes, allocations, NOW)
    by_key = {a.key: a for a in allocations}
    order = [d.request.key for d in plan.decisions]
    for head_key in {p.head for p in plan.preemptions}:
        head = next(r for r in requests if r.key == head_key)
        members = sorted((r for r in requests if r.job_id == head.job_id), key=lambda r: r.index)
        running = sum(a.job_id == head.job_id for a in allocations)
        need = len(members) if head.min_available is None else head.min_available - running
        if not head.gang or need <= 0 or members[0] != head:
            continue  # a single worker's preemption (members beyond a gang's minimum are decided as singles)
        gone = {(p.job_id, t) for p in plan.preemptions if p.head == head.key for t in p.task_ids}
        assert all(by_key[v].priority < head.priority for v in gone)
        for member in members:
            reason = plan.decision(member.key).reason
            assert reason is not None and reason.code == "Preempting"
            assert reason.text.startswith(f"Preempting {len(gone)} lower-priority worker(s) of ")
        # Once the victims are gone (what the pass placed before the gang staying), the members it needs fit whole,
        # as the next pass places them.
        before = [d for d in plan.decisions[: order.index(head.key)] if d.node is not None]
        rest = [a for a in allocations if a.key not in gone] + placed(Plan(decisions=before))
        again = schedule(members, nodes, rest, NOW)
        assert all(again.decision(m.key).node is not None for m in members[:need])
        # Meanwhile the gang keeps that room: the next pass, victims still stopping, says so for every member.
        kept = schedule(members, nodes, [*allocations, *placed(plan)], NOW, preempting={v: head.key for v in gone})
        assert {d.reason.text for d in kept.decisions if d.reason} == {
            f"Starting: waiting for {len(gone)} preempted worker(s) to stop"
        }
