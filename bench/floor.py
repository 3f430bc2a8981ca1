"""The Temporal floor: what the same dev server, fresh, takes to run N bare workflows of 3 no-op activities each,
started in one burst, with their worker in this process (outside the sandbox, the pydantic converter, as the control
plane)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker

from bench.common import (
    HistoryFigures,
    Pauses,
    fmt_latency,
    latency_rows,
    ms,
    now,
    own_cpu_seconds,
    pid_cpu_seconds,
    read_history,
    span,
    summary,
)
from bench.floor_workflow import ACTIVITIES, FLOOR_TASK_QUEUE, FloorWorkflow, noop
from bench.server_metrics import ServerOps, between, logged, settled
from workers.connect import connect
from workers.devserver import DevServer, free_port
from workers.services import WORKFLOW_RUNNER

READ_CONCURRENCY = 20


@dataclass
class Bare:
    id: str
    submitted: datetime | None = None
    start_ms: float | None = None  # the start_workflow call's round trip
    completed_at: datetime | None = None
    error: str | None = None
    history: HistoryFigures | None = None


@dataclass
class Floor:
    workflows: list[Bare]
    cpu: dict[str, float] = field(default_factory=dict)  # seconds during the burst: this process, the server
    server: ServerOps = field(default_factory=ServerOps)  # the server's own counters during the burst
    pauses: Pauses = field(default_factory=Pauses)  # the garbage collector's in this process during the burst

    @property
    def completed(self) -> list[Bare]:
        return [b for b in self.workflows if b.completed_at is not None]

    @property
    def wall_seconds(self) -> float | None:
        """First start (the client's clock) to the last completion (its history's last event)."""
        starts = [b.submitted for b in self.workflows if b.submitted is not None]
        ends = [b.completed_at for b in self.completed if b.completed_at is not None]
        if not starts or not ends or len(ends) < len(self.workflows):
            return None
        return (max(ends) - min(starts)).total_seconds()

    def figures(self) -> dict[str, Any]:
        done = self.completed
        histories = [b.history for b in self.workflows if b.history is not None]
        latencies = [ms(b.completed_at, b.submitted) for b in done]
        present = [v for v in latencies if v is not None]
        problems = collections.Counter(p for h in histories for p in h.workflow_task_problems + h.activity_problems)
        return {
            "workflows": len(self.workflows),
            "completed": len(done),
            "wall_seconds": self.wall_seconds,
            "start_span_seconds": span(b.submitted for b in self.workflows),
            "start_rpc_ms": summary([b.start_ms for b in self.workflows]),
            "start_to_complete_ms_p50": statistics.median(present) if present else None,
            "events_per_workflow_mean": statistics.mean(h.events for h in histories) if histories else None,
            "workflow_task_problems": sum(len(h.workflow_task_problems) for h in histories),
            "activity_retries": sum(len(h.activity_retries) for h in histories),
            "problems": dict(problems),
            "cpu_ms_per_workflow": {k: v * 1000 / max(len(done), 1) for k, v in self.cpu.items()},
            "server": self.server.figures(len(self.workflows)),
            "errors": [f"{b.id}: {b.error}" for b in self.workflows if b.error][:5],
        }

    def rows(self) -> list[tuple[str, str]]:
        f = self.figures()
        wall = f["wall_seconds"]
        cpu = f["cpu_ms_per_workflow"]
        rows = [
            ("floor: bare workflows (completed / started)", f"{f['completed']} / {f['workflows']}"),
            (f"floor: first start -> all complete ({ACTIVITIES} no-op activities each)", _seconds(wall)),
            ("floor: workflows per second", f"{f['completed'] / wall:.2f}" if wall else "n/a"),
            ("floor: first to last start", _seconds(f["start_span_seconds"])),
            ("floor: start call, median / p99 / max (ms)", fmt_latency([b.start_ms for b in self.workflows])),
            ("floor: history events per workflow, mean", _number(f["events_per_workflow_mean"])),
            (
                "floor: workflow task failures+timeouts / activity retries",
                f"{f['workflow_task_problems']} / {f['activity_retries']}",
            ),
            ("floor: CPU ms per workflow, this process / dev server", f"{cpu['this']:.0f} / {cpu['server']:.0f}"),
            ("floor: garbage collections in this process / CPU ms / longest ms", self.pauses.text()),
        ]
        rows += self.server.rows("floor: server", len(self.workflows))
        rows += [("floor: problems", f"{count} x {problem}") for problem, count in f["problems"].items()]
        rows += [("floor: not completed", e) for e in f["errors"]]
        rows += latency_rows("floor: start -> complete", [("workflow", v) for v in _present(self.completed)])
        phases = (p for b in self.completed if b.history for p in b.history.phases)
        rows += latency_rows("floor: history: activities and workflow tasks", phases)
        return rows


async def run_floor(root: Path | None, count: int, concurrency: int, timeout: float) -> Floor:
    """Start a fresh dev server under `root` (a new temporary directory if None), run `count` bare workflows in
    one burst (at most `concurrency` starts in flight), read their histories, stop the server."""
    with tempfile.TemporaryDirectory(prefix="astraeus-floor-", dir=root) as data_dir:
        server = DevServer(Path(data_dir), port=free_port(), ui_port=None, metrics_port=free_port())
        assert server.metrics_port is not None
        await asyncio.to_thread(server.start)
        try:
            client = await connect(server.address, wait=timedelta(seconds=30))
            worker = Worker(
                client,
                task_queue=FLOOR_TASK_QUEUE,
                workflows=[FloorWorkflow],
                activities=[noop],
                # The SDK's pollers, not the control plane's: they served bare workflows faster here (200 of them,
                # against the control plane's 50 then: 10.1 and 11.5 s against 14.2 and 11.6 s), and the floor is
                # the best the server does.
                max_concurrent_workflow_tasks=200,
                workflow_runner=WORKFLOW_RUNNER,  # run as the control plane runs ours (outside the sandbox)
            )
            floor = Floor([Bare(id=f"floor-{i:05d}") for i in range(count)])
            server_pid = server.process.pid if server.process else None
            async with worker:
                counters = await settled(server.metrics_port)
                _, log_start = logged(server.log, 0)
                before = {"this": own_cpu_seconds(), "server": pid_cpu_seconds(server_pid)}
                gate = asyncio.Semaphore(concurrency)
                runs = asyncio.gather(*(_start_and_wait(client, b, gate) for b in floor.workflows))
                with floor.pauses.counting(), contextlib.suppress(TimeoutError):  # what ended is reported
                    await asyncio.wait_for(runs, timeout)
                floor.cpu = {"this": own_cpu_seconds() - before["this"]}
                floor.cpu["server"] = pid_cpu_seconds(server_pid) - before["server"]
                floor.server = between(counters, await settled(server.metrics_port))
                floor.server.logged, _ = logged(server.log, log_start)
                read_gate = asyncio.Semaphore(READ_CONCURRENCY)
                await asyncio.gather(*(_read(client, b, read_gate) for b in floor.workflows))
        finally:
            await asyncio.to_thread(server.stop)
    return floor


async def _start_and_wait(client: Client, bare: Bare, gate: asyncio.Semaphore) -> None:
    async with gate:
        bare.submitted = now()
        began = time.monotonic()
        try:
            handle = await client.start_workflow(FloorWorkflow.run, id=bare.id, task_queue=FLOOR_TASK_QUEUE)
        except Exception as error:  # reported with the figures
            bare.error = f"start: {error}"
            return
        bare.start_ms = (time.monotonic() - began) * 1000
    try:
        await handle.result()
    except Exception as error:
        bare.error = f"result: {error}"


async def _read(client: Client, bare: Bare, gate: asyncio.Semaphore) -> None:
    if bare.submitted is None or bare.error:
        return
    async with gate:
        history = await client.get_workflow_handle(bare.id).fetch_history()
    bare.history = read_history(history.events)
    if history.events and history.events[-1].HasField("workflow_execution_completed_event_attributes"):
        bare.completed_at = history.events[-1].event_time.ToDatetime(tzinfo=UTC)


def _present(done: list[Bare]) -> list[float]:
    return [v for b in done if (v := ms(b.completed_at, b.submitted)) is not None]


def _seconds(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "n/a"


def _number(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "n/a"
