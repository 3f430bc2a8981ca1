"""The burst's steady state: what liveness costs while nothing happens. After the burst's runs are Running and read
back, a settle period, then a window in which no run changes: the CPU of each process of the cluster and the
server's own counters, per running worker-second and per second. Every request and write in the window is
liveness: the workers' heartbeats and the server's timers of their heartbeat timeouts, the machines' lease renewals
and their read-backs, the scheduler's lease and its sweep, the task queues' polls."""

from __future__ import annotations

import asyncio
import collections
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bench.server_metrics import WRITE, ServerOps, between, settled
from workflows.contracts import SA_NAMESPACE, SA_STATE
from workflows.domain.machine.liveness import renew_seconds
from workflows.domain.settings import Settings

if TYPE_CHECKING:
    from bench.cluster import Cluster
    from workers.client import AstraeusClient

HEARTBEATS = ("RecordActivityTaskHeartbeat", "RecordActivityTaskHeartbeatById")
SIGNALS = ("SignalWorkflowExecution", "SignalWithStartWorkflowExecution")
SHOWN = 8  # operations listed by name, most frequent first
CENSUS_CONCURRENCY = 20


@dataclass
class Steady:
    """One steady-state window: its length, the runs Running at its ends, what each process spent in it, and the
    server's counters between two settled scrapes."""

    seconds: float  # the window, by this process's monotonic clock
    settle: float  # waited before it, after the census
    machines: int
    running: tuple[int, int]  # burst runs Running (the visibility store) at the window's start and end
    cpu: dict[str, float]  # CPU seconds in the window, by process (Cluster.cpu)
    workers_cpu: tuple[float, int]  # the workers' processes (shims, fork servers): CPU seconds, shims alive
    server: ServerOps
    load: tuple[float, float]  # 1-minute load average at the window's start and end
    in_flight: collections.Counter[str] = field(default_factory=collections.Counter)  # activities, by type

    def figures(self) -> dict[str, Any]:
        seconds = max(self.seconds, 1e-9)
        worker_seconds = max(self.running[0], 1) * seconds  # each run is one worker
        per_ws = {k: v * 1000 / worker_seconds for k, v in self.cpu.items()}
        ours = sum(v for k, v in per_ws.items() if k != "server")
        writes = self.server.persistence[WRITE] / seconds
        renewal = lease_renewal_seconds()
        return {
            "running_workers": {"start": self.running[0], "end": self.running[1]},
            "window_seconds": self.seconds,
            "settle_seconds": self.settle,
            "load_average": {"start": self.load[0], "end": self.load[1]},
            "cpu_ms_per_worker_second": {**per_ws, "ours": ours, "ours_and_server": ours + per_ws.get("server", 0)},
            "workers_processes_cpu_ms_per_worker_second": self.workers_cpu[0] * 1000 / worker_seconds,
            "cores_busy": sum(self.cpu.values()) / seconds,
            "writes_per_second": writes,
            "writes_per_machine_per_second": writes / max(self.machines, 1),
            "lease_renewal_seconds": renewal,
            "writes_goal_per_second": self.machines / renewal,
            "heartbeats_per_second": sum(self.server.requests[k] for k in HEARTBEATS) / seconds,
            "signals_per_second": sum(self.server.requests[k] for k in SIGNALS) / seconds,
            "requests_per_second": _per_second(self.server.requests, seconds),
            "persistence_per_second": _per_second(self.server.persistence, seconds),
            "visibility_per_second": _per_second(self.server.visibility, seconds),
            "history_tasks_per_second": _per_second(self.server.tasks, seconds),
            "persistence_errors": dict(self.server.errors),
            "activities_in_flight": dict(self.in_flight.most_common()),
        }

    def rows(self) -> list[tuple[str, str]]:
        f = self.figures()
        cpu = {k: f"{v:.4f}" for k, v in f["cpu_ms_per_worker_second"].items()}
        workers = f"{f['workers_processes_cpu_ms_per_worker_second']:.4f}"
        writes = f"{f['writes_per_second']:.2f} / {f['writes_per_machine_per_second']:.3f}"
        goal = f"{f['writes_goal_per_second']:.2f} ({self.machines} / {f['lease_renewal_seconds']:g} s)"
        return [
            ("steady: running workers, window start / end", f"{self.running[0]} / {self.running[1]}"),
            ("steady: window / settled before it", f"{self.seconds:.1f} s / {self.settle:g} s"),
            ("steady: activities in flight at the start", _listed(self.in_flight) or "none"),
            ("steady: CPU ms per running worker-second, ours + server", cpu["ours_and_server"]),
            ("  ours / dev server", f"{cpu['ours']} / {cpu['server']}"),
            ("  ours: this process / services / agents", f"{cpu['this']} / {cpu['services']} / {cpu['agents']}"),
            ("  workers' processes (shims, fork servers), apart", workers),
            ("steady: cores busy (ours + server)", f"{f['cores_busy']:.2f} of {os.cpu_count()}"),
            ("steady: load average (1 min), start / end", f"{self.load[0]:.2f} / {self.load[1]:.2f}"),
            (f"steady: server writes ({WRITE}) per second / per machine", writes),
            ("  goal: machines / lease renewal interval", goal),
            (
                "steady: heartbeats recorded / signals, per second",
                f"{f['heartbeats_per_second']:.2f} / {f['signals_per_second']:.2f}",
            ),
            ("steady: server requests per second", _rates(f["requests_per_second"])),
            ("steady: persistence operations per second", _rates(f["persistence_per_second"])),
            ("steady: visibility store operations per second", _rates(f["visibility_per_second"])),
            ("steady: the history's tasks per second (timers, transfers)", _rates(f["history_tasks_per_second"])),
            ("steady: persistence errors", _listed(self.server.errors) or "0"),
        ]


def lease_renewal_seconds(settings: Settings | None = None) -> float:
    """How often an agent renews its machine's lease: three times within the stale grace (the lease carries its
    workers' liveness: workflows/domain/machine/liveness.py)."""
    return renew_seconds(settings or Settings())


async def measure_steady(
    cluster: Cluster, client: AstraeusClient, namespace: str, seconds: float, settle: float
) -> Steady:
    """The census of activities in flight, a settle period (the burst's and the census's requests and the workers'
    first heartbeats out of the way), then `seconds` of nothing happening. The CPU is read just before the first
    scrape and just before the last: each scrape waits until the server has published what it counted until then
    (`settled`), so both cover the same window."""
    print(f"steady state: census, {settle:g} s to settle, then a window of {seconds:g} s", file=sys.stderr)
    in_flight = await census(client)
    await asyncio.sleep(settle)
    port = cluster.server.metrics_port
    assert port is not None
    running_start = await count_running(client, namespace)
    load_start, cpu_start, began = os.getloadavg()[0], cluster.cpu(), time.monotonic()
    workers_start, _ = cluster.workers_cpu()
    server_start = await settled(port)
    await asyncio.sleep(max(0.0, seconds - (time.monotonic() - began)))
    cpu_end, window = cluster.cpu(), time.monotonic() - began
    (workers_end, alive), load_end = cluster.workers_cpu(), os.getloadavg()[0]
    server = between(server_start, await settled(port))
    running_end = await count_running(client, namespace)
    return Steady(
        seconds=window,
        settle=settle,
        machines=cluster.machines.count,
        running=(running_start, running_end),
        cpu={k: cpu_end[k] - cpu_start[k] for k in cpu_end},
        workers_cpu=(workers_end - workers_start, alive),
        server=server,
        load=(load_start, load_end),
        in_flight=in_flight,
    )


async def count_running(client: AstraeusClient, namespace: str) -> int:
    query = f'{SA_NAMESPACE}="{namespace}" AND {SA_STATE}="Running"'
    return (await client.temporal.count_workflows(query)).count


async def census(client: AstraeusClient) -> collections.Counter[str]:
    """The activities in flight in every open workflow, by type: who may heartbeat in the window (the server's
    counters do not say which activity a heartbeat came from)."""
    ids = [w.id async for w in client.temporal.list_workflows('ExecutionStatus="Running"')]
    gate = asyncio.Semaphore(CENSUS_CONCURRENCY)
    found: collections.Counter[str] = collections.Counter()

    async def pending(workflow_id: str) -> None:
        async with gate:
            described = await client.temporal.get_workflow_handle(workflow_id).describe()
        found.update(a.activity_type.name for a in described.raw_description.pending_activities)

    await asyncio.gather(*(pending(i) for i in ids))
    return found


def _per_second(counter: collections.Counter[str], seconds: float) -> dict[str, float]:
    return {k: v / seconds for k, v in counter.most_common()}


def _rates(rates: dict[str, float]) -> str:
    shown = ", ".join(f"{k} {v:.2f}" for k, v in list(rates.items())[:SHOWN])
    return f"{sum(rates.values()):.2f} ({shown})" if shown else "0"


def _listed(counter: collections.Counter[str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counter.most_common(SHOWN))
