"""Throughput and latency of runs on the embedded default: `python -m bench.runs [--runs N] [--machines M] ...`.

Starts `Embedded` (the Temporal dev server, the control plane, the scheduler and M local machines) in a temporary
directory on free ports, submits N runs of K workers each (`true`, or `sleep S`) concurrently, waits for every run
to end, then reads each run's own history (`describe`) and its Temporal event history. Prints figures only: it
asserts no timing.

Latencies are measured from the client's clock just before `start_workflow` (the headline) and from the run's
`created_at` (the workflow's clock when it first ran); Running and Completed times are the `at` of the
first run-history entry in that state. Client and server share this machine's clock.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.common import (
    fmt_latency,
    latency_rows,
    ms,
    now,
    pid_cpu_seconds,
    read_history,
    run_and_exit,
    table,
    wait_for_machines,
)
from workers.client import AstraeusClient
from workers.devserver import free_port
from workers.embedded import Embedded
from workers.errors import AstraeusError
from workflows.domain.spec import JobSpec, job_id, parse_spec

NAMESPACE = "default"
MACHINE_CPUS = 64.0
MACHINE_MEMORY_BYTES = 64 * 2**30
WORKER_CPU = 0.1
SUBMIT_CONCURRENCY = 20
READ_CONCURRENCY = 20
COUNTED = (
    "WORKFLOW_TASK_COMPLETED",
    "ACTIVITY_TASK_SCHEDULED",
    "WORKFLOW_EXECUTION_SIGNALED",
    "UPSERT_WORKFLOW_SEARCH_ATTRIBUTES",
)


@dataclass
class Run:
    name: str
    submitted: datetime | None = None  # the client's clock, just before start_workflow
    state: str = "Unknown"
    error: str | None = None
    created_at: datetime | None = None
    running_at: datetime | None = None
    completed_at: datetime | None = None
    history_events: int | None = None
    activity_retries: list[str] = field(default_factory=list)  # activities that needed more than one attempt
    steps: list[tuple[str, float]] = field(default_factory=list)  # each worker's `A -> B` state changes, in ms
    phases: list[tuple[str, float]] = field(default_factory=list)  # activities, workflow tasks: queued, ran (ms)
    counts: collections.Counter[str] = field(default_factory=collections.Counter)  # history events by kind
    workflow_task_problems: list[str] = field(default_factory=list)  # workflow tasks that failed or timed out
    run_history: list[str] = field(default_factory=list)


def spec_for(
    name: str, workers: int, sleep: float, gang: bool = False, namespace: str = NAMESPACE, gpus: int = 0
) -> JobSpec:
    """One group of `workers` replicas running `true` (or `sleep S`), restart policy Never, 0.1 CPU and no memory
    each (so that only GPUs can make a run wait)."""
    command = ["true"] if sleep <= 0 else ["sleep", f"{sleep:g}"]
    return parse_spec(
        {
            "name": name,
            "namespace": namespace,
            "gang": gang,
            "groups": [
                {
                    "name": "worker",
                    "replicas": workers,
                    "command": command,
                    "cpu": WORKER_CPU,
                    "memory_bytes": 0,
                    "gpus": gpus,
                    "restart_policy": "Never",
                }
            ],
        }
    )


async def submit_and_wait(client: AstraeusClient, run: Run, spec: JobSpec, gate: asyncio.Semaphore) -> None:
    async with gate:
        run.submitted = now()
        try:
            await client.submit(spec)
        except Exception as error:  # reported, not raised: one bad submit must not hide the others' figures
            run.error = f"submit: {error}"
            return
    try:
        status = await client.result(spec.namespace, spec.name)  # a Failed or Cancelled run's workflow fails
        run.state = status.state
    except Exception as error:
        run.error = f"result: {error}"


async def read_back(client: AstraeusClient, run: Run, gate: asyncio.Semaphore) -> None:
    """The run's own history (a query, answered by replay once the workflow closed) and its event count."""
    if run.submitted is None or (run.error and run.error.startswith("submit")):
        return
    async with gate:
        try:
            described = await client.describe(NAMESPACE, run.name)
        except AstraeusError as error:
            run.error = run.error or f"describe: {error}"
        else:
            run.state = described.status.state
            run.created_at = described.status.created_at
            run.run_history = [f"{e.state}: {e.reason}" for e in described.history]
            run.running_at = next((e.at for e in described.history if e.state == "Running"), None)
            run.completed_at = next((e.at for e in described.history if e.state == "Completed"), None)
            for task in described.tasks:
                for before, after in itertools.pairwise(task.history):
                    run.steps.append((f"{before.state} -> {after.state}", ms(after.at, before.at) or 0.0))
        history = await client.temporal.get_workflow_handle(job_id(NAMESPACE, run.name)).fetch_history()
        figures = read_history(history.events)
        run.history_events = figures.events
        run.counts = figures.counts
        run.phases = figures.phases
        run.activity_retries = [f"{name} retried ({why})" for name, why in figures.activity_retries]
        run.workflow_task_problems = figures.workflow_task_problems


def mean_count(runs: list[Run], kind: str) -> float:
    return statistics.mean(r.counts[kind] for r in runs) if runs else float("nan")


async def bench(runs: int, machines: int, workers: int, sleep: float, timeout: float, gang: bool = False) -> list[str]:
    lines: list[str] = []
    # SIGTERM (timeout, kill) cancels the benchmark, so that Embedded stops the dev server and its machines.
    this = asyncio.current_task()
    assert this is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    with tempfile.TemporaryDirectory(prefix="astraeus-bench-") as data_dir:
        embedded = Embedded(
            Path(data_dir),
            port=free_port(),
            ui_port=None,
            nodes=machines,
            cpus=MACHINE_CPUS,
            memory_bytes=MACHINE_MEMORY_BYTES,
        )
        started = time.monotonic()
        async with embedded:
            assert embedded.client is not None
            client = AstraeusClient(embedded.client, control_build=embedded.control_build)
            await wait_for_machines(client, machines)
            print(f"cluster up in {time.monotonic() - started:.1f} s; submitting {runs} runs", file=sys.stderr)

            server_pid = embedded.server.process.pid if embedded.server.process else None
            before = cpu_seconds(server_pid)
            stamp = int(time.time())
            batch = [Run(name=f"bench-{stamp}-{i}") for i in range(runs)]
            gate = asyncio.Semaphore(SUBMIT_CONCURRENCY)
            waits = [submit_and_wait(client, r, spec_for(r.name, workers, sleep, gang), gate) for r in batch]
            try:
                await asyncio.wait_for(asyncio.gather(*waits), timeout)
            except TimeoutError:
                print(f"timed out after {timeout:g} s; reporting what ended", file=sys.stderr)
            after = cpu_seconds(server_pid)
            cpu = {k: after[k] - before[k] for k in before} | {"load": after["load"], "load_before": before["load"]}

            read_gate = asyncio.Semaphore(READ_CONCURRENCY)
            await asyncio.gather(*(read_back(client, r, read_gate) for r in batch))
        lines += report(batch, machines, workers, sleep, cpu)
    return lines


def cpu_seconds(server_pid: int | None) -> dict[str, float]:
    """CPU time so far of this process (control plane, scheduler, agents, client: every thread) and of the dev
    server; and the load average, for a shared machine. (The shims are left out: they are reaped late.)"""
    times = os.times()
    server = pid_cpu_seconds(server_pid)
    return {
        "process": times.user + times.system,
        "server": server,
        "wall": time.monotonic(),
        "load": os.getloadavg()[0],
    }


def report(batch: list[Run], machines: int, workers: int, sleep: float, cpu: dict[str, float]) -> list[str]:
    completed = [r for r in batch if r.state == "Completed"]
    submits = [r.submitted for r in batch if r.submitted is not None]
    ends = [r.completed_at for r in completed if r.completed_at is not None]
    wall = (max(ends) - min(submits)).total_seconds() if ends and submits else float("nan")
    retries = sum(len(r.activity_retries) for r in batch)
    task_problems = sum(len(r.workflow_task_problems) for r in batch)
    events = [r.history_events for r in batch if r.history_events is not None]
    submit_span = (max(submits) - min(submits)).total_seconds() if submits else float("nan")
    never_running = [r for r in completed if r.running_at is None]
    command = "true" if sleep <= 0 else f"sleep {sleep:g}"

    def latency(later: str, earlier: str) -> str:
        return fmt_latency([ms(getattr(r, later), getattr(r, earlier)) for r in completed])

    rows = [
        ("runs (completed / submitted)", f"{len(completed)} / {len(batch)}"),
        ("machines", str(machines)),
        ("workers per run", f"{workers} ({command})"),
        ("wall time, first submit to last completion", f"{wall:.2f} s"),
        ("first to last submit", f"{submit_span:.2f} s"),
        ("runs per second", f"{len(completed) / wall:.2f}" if wall > 0 else "n/a"),
        ("workers per second", f"{len(completed) * workers / wall:.2f}" if wall > 0 else "n/a"),
        ("submit -> Running, median / p99 / max (ms)", latency("running_at", "submitted")),
        ("submit -> Completed, median / p99 / max (ms)", latency("completed_at", "submitted")),
        ("  submit -> created_at, median / p99 / max (ms)", latency("created_at", "submitted")),
        ("  created_at -> Running, median / p99 / max (ms)", latency("running_at", "created_at")),
        ("  created_at -> Completed, median / p99 / max (ms)", latency("completed_at", "created_at")),
        ("history events per run, mean / max", f"{statistics.mean(events):.1f} / {max(events)}" if events else "n/a"),
        (
            "per run: workflow tasks / activities / signals / search-attribute upserts",
            " / ".join(f"{mean_count(completed, kind):.1f}" for kind in COUNTED),
        ),
        ("retried activities, workflow task failures+timeouts", f"{retries} / {task_problems} (all runs)"),
    ]
    count = max(len(completed), 1)
    rows += [
        (
            "CPU ms per run: this process / dev server",
            f"{cpu['process'] * 1000 / count:.0f} / {cpu['server'] * 1000 / count:.0f}",
        ),
        (
            "cores busy: this process + dev server, of the machine's",
            f"{(cpu['process'] + cpu['server']) / cpu['wall']:.2f} of {os.cpu_count()}",
        ),
        ("load average (1 min), start / end", f"{cpu['load_before']:.2f} / {cpu['load']:.2f} (others' work counts)"),
    ]
    for title, attribute in (
        ("worker state changes", "steps"),
        ("history: activities and workflow tasks, queued and ran", "phases"),
    ):
        rows += latency_rows(title, (item for r in completed for item in getattr(r, attribute)))
    lines = table(rows)
    if never_running:
        lines.append(f"note: {len(never_running)} completed runs never recorded Running, e.g. {never_running[0].name}:")
        lines += [f"  {entry}" for entry in never_running[0].run_history]
    trouble = collections.Counter(p for r in batch for p in r.workflow_task_problems + r.activity_retries)
    for problem, count in trouble.most_common():
        lines.append(f"{count:4d} x {problem}")
    failed = [r for r in batch if r.state != "Completed"]
    for r in failed[:5]:
        lines.append(f"not completed: {r.name}: {r.state} {r.error or ''}".rstrip())
        lines += [f"  {entry}" for entry in r.run_history[-3:]]
    if len(failed) > 5:
        lines.append(f"... and {len(failed) - 5} more not completed")
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.runs", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=100, help="runs to submit (default 100)")
    p.add_argument("--machines", type=int, default=4, help="local machines (agents) (default 4)")
    p.add_argument("--workers-per-run", type=int, default=1, help="workers (replicas) per run (default 1)")
    p.add_argument("--sleep", type=float, default=0, help="seconds each worker sleeps; 0 runs `true` (default 0)")
    p.add_argument("--gang", action="store_true", help="each run is a gang: placed whole, started at a barrier")
    p.add_argument("--timeout", type=float, default=900, help="give up waiting for runs after this (default 900 s)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    run_and_exit(bench(args.runs, args.machines, args.workers_per_run, args.sleep, args.timeout, args.gang))


if __name__ == "__main__":
    main()
