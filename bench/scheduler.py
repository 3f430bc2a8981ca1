"""The scheduler's pure core at scale: `python -m bench.scheduler [--machines 1000] [--gpus 8] [--runs 10000]`.

Builds a cluster of M machines of G GPUs, fills part of it with running work (mixed sizes, priorities, time limits),
queues N runs of mixed sizes (1 to 8 GPUs, a quarter with time limits, some with selections, several namespaces
with quotas), then times:

- a full pass (`schedule`) over the whole queue, cold, and again over the same view;
- the same pass with gang runs in the queue (`--gangs` runs of 2 to 64 workers, placed whole or not at all; the
  head gang preempts lower-priority work, or, when running work outranks it, holds a machine for every member);
- one placement decision: a single worker that fits, against the prebuilt cluster (index, checks, best fit);
- one waiting decision: a worker that fits nowhere, with every machine's reasons (explanations warm and cold);
- the cost of building the pass's view (compiling machines, indexing, what each holds), and with the machines kept
  from the pass before, as the scheduler service keeps them.

Figures only; it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from workflows.domain.constraints import NodeSelection
from workflows.domain.inventory import GpuInfo, NodeInventory, NodeState, NodeView
from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.scheduling.explaining import Explainer
from workflows.domain.scheduling.machines import Cluster, Compiled
from workflows.domain.scheduling.placement import ask_for, fits
from workflows.domain.scheduling.queue import schedule
from workflows.domain.scheduling.quotas import Quota

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
SIZES = [1, 1, 1, 2, 2, 4, 4, 8]  # GPUs per worker: mostly small, some whole machines


def machines(count: int, gpus: int) -> list[NodeView]:
    nodes = []
    for i in range(count):
        name = f"gpu-{i:04d}"
        h100 = "NVIDIA H100 80GB HBM3"
        inventory = NodeInventory(
            name=name,
            cpus=128,
            memory_bytes=2 * 2**40,
            gpus=[GpuInfo(index=g, uuid=f"GPU-{i}-{g}", model=h100, memory_bytes=80 * 2**30) for g in range(gpus)],
            labels={"topology.astraeus.io/rack": f"r{i // 32}", "zone": "a" if i % 2 else "b"},
            pools=["training" if i % 4 else "inference"],
        )
        nodes.append(NodeView(name=name, state=NodeState.DOWN if i % 97 == 0 else NodeState.READY, inventory=inventory))
    return nodes


def running(nodes: list[NodeView], fill: float, rnd: random.Random) -> list[Allocation]:
    """Running work on about `fill` of the GPUs."""
    allocations = []
    for node in nodes:
        assert node.inventory is not None
        free, i = len(node.inventory.gpus), 0
        while free and rnd.random() < fill:
            size = min(rnd.choice(SIZES), free)
            free -= size
            allocations.append(
                Allocation(
                    job_id=f"job/ns{rnd.randrange(10)}/run-{node.name}-{i}",
                    task_id="w-0",
                    attempt=0,
                    node=node.name,
                    cpu=8 * size,
                    memory_bytes=size * 64 * 2**30,
                    gpus=size,
                    priority=rnd.randrange(4),
                    started_at=NOW - timedelta(minutes=rnd.randrange(600)),
                    time_limit_seconds=rnd.choice([None, 3600, 4 * 3600, 12 * 3600]),
                )
            )
            i += 1
    return allocations


def queued(count: int, rnd: random.Random) -> list[TaskRequest]:
    requests = []
    for i in range(count):
        size = rnd.choice(SIZES)
        selection = None
        if i % 10 == 0:
            selection = NodeSelection(labels={"zone": "a"})
        elif i % 10 == 1:
            selection = NodeSelection(pools=("inference",))
        requests.append(
            TaskRequest(
                job_id=f"job/ns{rnd.randrange(10)}/queued-{i}",
                namespace=f"ns{i % 10}",
                task_id="w-0",
                index=0,
                attempt=0,
                priority=rnd.choice([0, 0, 0, 1, 1, 2, 3]),
                submitted_at=NOW - timedelta(seconds=count - i),
                cpu=8 * size,
                memory_bytes=size * 64 * 2**30,
                gpus=size,
                time_limit_seconds=rnd.choice([None, None, None, 1800]),
                selection=selection,
            )
        )
    return requests


def gang_runs(count: int, rnd: random.Random) -> list[TaskRequest]:
    """Gang runs of 2 to 8 workers (some of 64) of 4 or 8 GPUs each, a few with min_available, in several
    namespaces, each claiming before the single workers of its priority."""
    requests = []
    for i in range(count):
        workers, size = rnd.choice([2, 2, 4, 4, 8, 64]), rnd.choice([4, 8, 8])
        minimum = workers // 2 if i % 5 == 0 else None
        namespace = f"ns{i % 10}"
        priority = rnd.choice([0, 0, 1, 2, 3])
        for w in range(workers):
            requests.append(
                TaskRequest(
                    job_id=f"job/{namespace}/gang-{i}",
                    namespace=namespace,
                    task_id=f"w-{w}",
                    index=w,
                    attempt=0,
                    priority=priority,
                    submitted_at=NOW - timedelta(days=1, seconds=count - i),  # claims before the single workers
                    cpu=8 * size,
                    memory_bytes=size * 64 * 2**30,
                    gpus=size,
                    gang=True,
                    min_available=minimum,
                )
            )
    return requests


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def show(label: str, samples: list[float], per: int = 1) -> None:
    median = statistics.median(samples) / per
    unit, scale = ("ms", 1e3) if median >= 1e-3 else ("µs", 1e6)
    print(f"  {label:<58} {median * scale:9.1f} {unit}  (best {min(samples) / per * scale:.1f}, n={len(samples)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--fill", type=float, default=0.8, help="chance of each further worker on a machine")
    parser.add_argument("--gangs", type=int, default=200, help="gang runs added to the queue for the gang pass")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    rnd = random.Random(7)
    nodes = machines(args.machines, args.gpus)
    allocations = running(nodes, args.fill, rnd)
    requests = queued(args.runs, rnd)
    quotas = {f"ns{i}": Quota(namespace=f"ns{i}", gpus=args.machines * args.gpus // 8) for i in range(0, 10, 3)}
    held = sum(a.gpus for a in allocations)
    print(f"cluster: {args.machines} machines x {args.gpus} GPUs, {len(allocations)} workers running on {held} GPUs "
          f"({held / (args.machines * args.gpus):.0%}); queue: {len(requests)} runs")  # fmt: skip

    plan = schedule(requests, nodes, allocations, NOW, quotas=quotas)
    codes = Counter(d.reason.code if d.reason else "Placed" for d in plan.decisions)
    print("one pass decides: " + ", ".join(f"{code} {n}" for code, n in codes.most_common()))
    print(f"  preemptions: {len(plan.preemptions)}, heads holding room: {len(plan.holds)}")

    print("\nfull pass (schedule over the whole queue):")
    passes = timed(lambda: schedule(requests, nodes, allocations, NOW, quotas=quotas), args.repeat)
    show("per pass", passes)
    show("per decision (pass / queued runs)", passes, per=len(requests))

    # The same queue when running work outranks it: nothing to preempt, so the head holds room and the rest backfill.
    senior = [a.model_copy(update={"priority": a.priority + 10}) for a in allocations]
    plan = schedule(requests, nodes, senior, NOW, quotas=quotas)
    codes = Counter(d.reason.code if d.reason else "Placed" for d in plan.decisions)
    print("\nwhen running work outranks the queue, one pass decides: "
          + ", ".join(f"{code} {n}" for code, n in codes.most_common()))  # fmt: skip
    print(f"  heads holding room: {len(plan.holds)}")
    reserving = timed(lambda: schedule(requests, nodes, senior, NOW, quotas=quotas), args.repeat)
    show("per pass", reserving)
    show("per decision (pass / queued runs)", reserving, per=len(requests))

    with_gangs = requests + gang_runs(args.gangs, rnd)
    plan = schedule(with_gangs, nodes, allocations, NOW, quotas=quotas)
    codes = Counter(d.reason.code if d.reason else "Placed" for d in plan.decisions if d.request.gang)
    print(f"\nwith {args.gangs} gang runs ({len(with_gangs) - len(requests)} workers) in the queue, their workers: "
          + ", ".join(f"{code} {n}" for code, n in codes.most_common()))  # fmt: skip
    victims = sum(len(p.task_ids) for p in plan.preemptions)
    print(f"  preemptions: {victims} workers of {len(plan.preemptions)} runs, heads holding room: {len(plan.holds)}")
    ganged = timed(lambda: schedule(with_gangs, nodes, allocations, NOW, quotas=quotas), args.repeat)
    show("per pass", ganged)
    show("per decision (pass / queued workers)", ganged, per=len(with_gangs))
    plan = schedule(with_gangs, nodes, senior, NOW, quotas=quotas)
    codes = Counter(d.reason.code if d.reason else "Placed" for d in plan.decisions if d.request.gang)
    print("  when running work outranks the queue: " + ", ".join(f"{code} {n}" for code, n in codes.most_common()))
    show("per pass", timed(lambda: schedule(with_gangs, nodes, senior, NOW, quotas=quotas), args.repeat))

    print("\nthe pass's view:")
    show("build (compile machines, index free GPUs, what each holds)", timed(lambda: Cluster(nodes, allocations, NOW),
                                                                          args.repeat))  # fmt: skip
    kept = Compiled()
    kept(nodes)
    show("build, the machines kept from the last pass (the service's)",
         timed(lambda: Cluster(nodes, allocations, NOW, kept), args.repeat))  # fmt: skip

    cluster = Cluster(nodes, allocations, NOW)
    fitting = next(r for r in requests if r.gpus == 1 and r.selection is None)
    ask = ask_for(fitting, cluster, {})

    def place_one() -> str | None:
        for name in cluster.candidates(fitting):
            if fits(cluster.machines[name], cluster.free[name], ask):
                return name
        return None

    print("\none decision against the built view:")
    assert place_one() is not None
    show("placement (a 1-GPU worker: index, checks, best fit)", timed(place_one, 2000))
    big = fitting.model_copy(update={"gpus": args.gpus, "cpu": 1.0, "memory_bytes": 0, "task_id": "big"})
    big_ask = ask_for(big, cluster, {})
    show(
        "a whole-machine worker",
        timed(
            lambda: next(
                (n for n in cluster.candidates(big) if fits(cluster.machines[n], cluster.free[n], big_ask)), None
            ),
            2000,
        ),
    )
    huge = big.model_copy(update={"gpus": args.gpus * 2, "task_id": "huge"})
    huge_ask = ask_for(huge, cluster, {})
    show(
        "waiting: every machine's reasons, cold",
        timed(lambda: Explainer(cluster).reasons(huge_ask, cluster.names, None), args.repeat * 3),
    )
    warm = Explainer(cluster)
    warm.reasons(huge_ask, cluster.names, None)
    show(
        "waiting: every machine's reasons, same shape again",
        timed(lambda: warm.reasons(huge_ask, cluster.names, None), 2000),
    )
    print("\nratios:")
    print(
        f"  a pass costs {statistics.median(passes) / statistics.median(timed(place_one, 200)):,.0f} single placements"
    )


if __name__ == "__main__":
    main()
