"""Astraeus's own Prometheus metrics, every one in this module (the README lists them). The scheduler's figures are
read from its view at each pass: a snapshot that the endpoint turns into gauges when it is scraped, so that a scrape
never sees half a pass. A process serves them with `--metrics HOST:PORT` (workers/telemetry.py)."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from workflows.domain.inventory import NodeView
from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.scheduling.plans import Plan

PLACEMENTS = Counter(
    "astraeus_placement_decisions",
    "The scheduler's decisions, by outcome: placed on a machine, or waiting (decided again at each pass)",
    ["outcome"],
)
PASS_SECONDS = Histogram(
    "astraeus_scheduler_pass_seconds",
    "How long one scheduling pass took",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)
TIME_TO_PLACEMENT = Histogram(
    "astraeus_pending_to_placed_seconds",
    "From a run's submission (Pending) to the placement of each of its workers' first attempt",
    ["namespace"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600),
)
RESTARTS = Counter(
    "astraeus_worker_restarts",
    "Workers' later attempts (restarts, by policy or of a gang) that the scheduler placed",
    ["namespace"],
)
PREEMPTIONS = Counter("astraeus_preemptions", "Workers the scheduler preempted for higher-priority work", ["namespace"])


@dataclass(frozen=True)
class SchedulerFigures:
    """What the scheduler's view holds after a pass."""

    runs: dict[tuple[str, str], int] = field(default_factory=dict)  # (namespace, waiting|placed) -> runs
    workers: dict[tuple[str, str], int] = field(default_factory=dict)  # (namespace, waiting|placed) -> workers
    gpus: dict[tuple[str, str], int] = field(default_factory=dict)  # (machine, free|used) -> GPUs


def figures(
    requests: Iterable[TaskRequest], allocations: Iterable[Allocation], nodes: Iterable[NodeView]
) -> SchedulerFigures:
    """Runs and workers by namespace and state (a run with a worker waiting for a machine counts as waiting), and
    each machine's GPUs free and used."""
    waiting = {(r.job_id, r.namespace) for r in requests}
    workers = Tally((r.namespace, "waiting") for r in requests)
    namespaces = {r.job_id: r.namespace for r in requests}
    placed: set[tuple[str, str]] = set()
    used = Tally[str]()
    for a in allocations:
        namespace = namespaces.get(a.job_id) or _namespace(a.job_id)
        workers[(namespace, "placed")] += 1
        placed.add((a.job_id, namespace))
        used[a.node] += a.gpus
    runs = Tally((ns, "waiting") for _, ns in waiting)
    runs.update((ns, "placed") for job, ns in placed - waiting)
    gpus: dict[tuple[str, str], int] = {}
    for view in nodes:
        total = len(view.inventory.gpus) if view.inventory is not None else 0
        gpus[(view.name, "used")] = used[view.name]
        gpus[(view.name, "free")] = max(total - used[view.name], 0)
    return SchedulerFigures(runs=dict(runs), workers=dict(workers), gpus=gpus)


def _namespace(job_id: str) -> str:
    """A run's namespace from its workflow id, `job/<namespace>/<name>`."""
    parts = job_id.split("/")
    return parts[1] if len(parts) == 3 else ""


def observe_pass(plan: Plan, now: datetime) -> None:
    """Count a pass's decisions and preemptions."""
    for decision in plan.decisions:
        request = decision.request
        PLACEMENTS.labels("placed" if decision.node is not None else "waiting").inc()
        if decision.node is None:
            continue
        if request.attempt == 0:
            TIME_TO_PLACEMENT.labels(request.namespace).observe(max((now - request.submitted_at).total_seconds(), 0))
        else:
            RESTARTS.labels(request.namespace).inc()
    for preemption in plan.preemptions:
        PREEMPTIONS.labels(_namespace(preemption.job_id)).inc(len(preemption.task_ids))


# The scheduler's view as a scrape reads it: its waiting workers, its placements and its machines, each a list
# taken at once (a pass changes them on another thread).
View = Callable[[], tuple[list[TaskRequest], list[Allocation], list[NodeView]]]


class SchedulerCollector(Collector):
    """The gauges of the scheduler's view, counted when they are scraped rather than at every pass (a pass runs
    every few milliseconds in a burst); none in other processes."""

    view: View | None = None

    def watch(self, view: View) -> None:
        self.view = view

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # nothing to check for duplicates before a scheduler is watched

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.view is None:
            return
        now = figures(*self.view())
        for name, what, label, values in (
            ("astraeus_runs", "Runs the scheduler holds, by namespace and state", "namespace", now.runs),
            ("astraeus_workers", "Workers the scheduler holds, by namespace and state", "namespace", now.workers),
            ("astraeus_gpus", "GPUs of each machine, free or used, as the scheduler sees them", "machine", now.gpus),
        ):
            family = GaugeMetricFamily(name, what, labels=[label, "state"])
            for (key, state), value in sorted(values.items()):
                family.add_metric([key, state], value)
            yield family


SCHEDULER = SchedulerCollector()
REGISTRY.register(SCHEDULER)
