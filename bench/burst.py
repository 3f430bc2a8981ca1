"""A burst of one-GPU runs on M machines of G GPUs, against the Temporal floor: `python -m bench.burst [--runs N]
[--machines M] [--gpus G] [--idle K] [--agents-per-process A] [--services-apart] [--control-processes C]
[--steady S] [--settle W] [--no-floor] [--json FILE]`.

Starts the embedded default's Temporal dev server (file database, headless, free ports, a temporary directory), the
control plane and the scheduler in this process (`--services-apart`: as `astraeus control` and `astraeus scheduler`
processes; `--control-processes C`: C of `astraeus control`), and M machines, each a real agent declaring G GPUs
(`bench.agents`: all in one process by default, `--agents-per-process`). Submits K runs one at a time on the idle
cluster (each waits until Running, then they are cancelled), then N runs of one worker of one GPU (`sleep 3000`, restart
policy Never) at once, at most 50 submits in flight, and waits until min(N, M x G) of them are Running (the search
attribute `AstraeusState`). Then it reads each run (`describe`, its Temporal event history, its pending activities) and
the machines' workflows; then, unless `--steady 0`, measures the steady state (`bench/steady.py`: W s to settle, then
S s in which nothing happens); ends every process it started, and runs the floor: a fresh dev server completing
min(N, M x G) bare workflows of 3 no-op activities in one burst.
Prints figures only: it asserts no timing.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from prometheus_client import REGISTRY

from bench.burst_checks import GPUS, check
from bench.burst_report import figures, lines, pair_figures, pair_lines, pair_row
from bench.chaos_checks import Interval
from bench.cluster import Cluster, Machines
from bench.common import HistoryFigures, Pauses, ms, now, read_history, run_and_exit
from bench.floor import Floor, run_floor
from bench.runs import spec_for
from bench.server_metrics import ServerOps, between, logged, settled
from bench.steady import Steady, measure_steady
from workers.client import AstraeusClient
from workers.errors import AstraeusError
from workers.outcomes import run_result
from workflows.contracts import SA_NAMESPACE, SA_STATE
from workflows.domain.spec import job_id

NAMESPACE = "burst"
IDLE_NAMESPACE = "idle"
SUBMIT_CONCURRENCY = 50
READ_CONCURRENCY = 20
POLL_SECONDS = 0.5
IDLE_POLL_SECONDS = 0.05


@dataclass
class Run:
    name: str
    namespace: str = NAMESPACE
    submitted: datetime | None = None  # the client's clock, just before start_workflow
    submit_ms: float | None = None  # the start_workflow call's round trip
    error: str | None = None
    state: str = "Unknown"
    reason: str = ""
    code: str = ""
    worker: str = ""  # its worker's id
    worker_state: str = ""
    worker_reason: str = ""
    worker_code: str = ""
    attempt: int = 0  # its worker's attempt
    node: str | None = None  # its worker's machine
    created_at: datetime | None = None
    running_at: datetime | None = None  # the first run-history entry in state Running
    steps: list[tuple[str, float]] = field(default_factory=list)  # its worker's `A -> B` state changes, in ms
    reasons_waited: list[str] = field(default_factory=list)  # its worker's distinct reasons while Pending
    history: HistoryFigures | None = None
    pending_retries: list[tuple[str, str]] = field(default_factory=list)  # activities in flight, attempt > 1


@dataclass
class Options:
    runs: int
    machines: int
    gpus: int
    sleep: float
    idle: int
    agents_per_process: int
    services_apart: bool
    controls: int  # `astraeus control` processes (more than 1: the services apart)
    floor: bool
    floor_runs: int | None
    timeout: float
    json_path: Path | None
    data_dir: Path | None
    pairs: int = 1  # bursts, each followed by its floor: on a shared machine each pair's ratio, and their median
    steady: float = 60  # seconds of the steady-state window after the burst (0: none)
    settle: float = 20  # seconds waited before that window

    @property
    def target(self) -> int:
        """Runs that can be Running at once: every other one waits."""
        return min(self.runs, self.machines * self.gpus)


# ---- the burst ---------------------------------------------------------------------------------------------------


async def submit(client: AstraeusClient, run: Run, sleep: float, gate: asyncio.Semaphore) -> None:
    spec = spec_for(run.name, 1, sleep, namespace=run.namespace, gpus=GPUS)
    async with gate:
        run.submitted = now()
        began = time.monotonic()
        try:
            await client.submit(spec)
        except Exception as error:  # reported, not raised: one bad submit must not hide the others' figures
            run.error = f"submit: {error}"
        run.submit_ms = (time.monotonic() - began) * 1000


async def count(client: AstraeusClient, query: str) -> int:
    return (await client.temporal.count_workflows(query)).count


async def wait_running(client: AstraeusClient, target: int, timeout: float) -> int:
    """Until `target` burst runs are Running (or Running and ended, should some fail), polling the visibility
    store only, with one query a poll (each shares the server's one database connection with the burst's writes;
    the floor's wait asks nothing); returns how many are Running."""
    deadline = time.monotonic() + timeout
    reported = time.monotonic()
    ours = f'{SA_NAMESPACE}="{NAMESPACE}"'
    while True:
        reached = await count(client, f'{ours} AND ({SA_STATE}="Running" OR ExecutionStatus!="Running")')
        if reached >= target or time.monotonic() > deadline:
            return await count(client, f'{ours} AND {SA_STATE}="Running"')
        if time.monotonic() - reported > 10:
            reported = time.monotonic()
            print(f"  {reached} of {target} Running (or ended)", file=sys.stderr)
        await asyncio.sleep(POLL_SECONDS)


async def read_back(client: AstraeusClient, run: Run, gate: asyncio.Semaphore) -> None:
    """Its `describe` (run and worker histories, reasons), its event history, and its activities in flight."""
    if run.submitted is None or run.error:
        return
    handle = client.temporal.get_workflow_handle(job_id(run.namespace, run.name))
    async with gate:
        try:
            described = await client.describe(run.namespace, run.name)
        except AstraeusError as error:
            run.error = f"describe: {error}"
            return
        history = await handle.fetch_history()
        execution = await handle.describe()
    run.state, run.reason, run.code = described.status.state, described.status.reason, described.status.code
    run.created_at = described.status.created_at
    run.running_at = next((e.at for e in described.history if e.state == "Running"), None)
    for task in described.tasks:
        run.worker, run.attempt, run.node = task.id, task.attempt, task.node
        run.worker_state, run.worker_reason, run.worker_code = task.status.state, task.status.reason, task.status.code
        run.reasons_waited = list(dict.fromkeys(e.reason for e in task.history if e.state == "Pending"))
        for before, after in itertools.pairwise(task.history):
            run.steps.append((f"{before.state} -> {after.state}", ms(after.at, before.at) or 0.0))
    run.history = read_history(history.events)
    run.pending_retries = [
        (a.activity_type.name, a.last_failure.message[:200] or "no failure recorded")
        for a in execution.raw_description.pending_activities
        if a.attempt > 1
    ]


async def idle_runs(client: AstraeusClient, count_: int, sleep: float) -> list[Run]:
    """Runs submitted one at a time on the idle cluster, each once the one before is Running; then cancelled
    (each waits for its workflow to end), so that the burst finds every GPU free."""
    runs = [Run(name=f"idle-{i:03d}", namespace=IDLE_NAMESPACE) for i in range(count_)]
    gate = asyncio.Semaphore(1)
    for run in runs:
        await submit(client, run, sleep, gate)
        query = f'WorkflowId="{job_id(run.namespace, run.name)}" AND {SA_STATE}="Running"'
        deadline = time.monotonic() + 60
        while not run.error and await count(client, query) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(IDLE_POLL_SECONDS)
    await asyncio.gather(*(read_back(client, r, gate) for r in runs))
    await asyncio.gather(*(cancel(client, r) for r in runs))
    return runs


async def cancel(client: AstraeusClient, run: Run) -> None:
    try:
        await client.cancel(run.namespace, run.name)
        await asyncio.wait_for(run_result(client.temporal.get_workflow_handle(job_id(run.namespace, run.name))), 60)
    except Exception as error:  # figures first; a run that will not end is stopped with everything else
        print(f"  could not cancel {run.name}: {error}", file=sys.stderr)


async def machine_workflows(client: AstraeusClient) -> dict[str, int]:
    """History length of every workflow that is not a run (the machines', the quotas')."""
    lengths = {}
    async for execution in client.temporal.list_workflows('WorkflowType!="JobWorkflow"'):
        lengths[execution.id] = (await client.temporal.get_workflow_handle(execution.id).describe()).history_length
    return lengths


async def machine_histories(client: AstraeusClient, ids: Sequence[str]) -> list[HistoryFigures]:
    figures = []
    for workflow_id in ids:
        history = await client.temporal.get_workflow_handle(workflow_id).fetch_history()
        figures.append(read_history(history.events))
    return figures


@dataclass
class Burst:
    options: Options
    idle: list[Run]
    runs: list[Run]
    running_seen: int  # Running in the visibility store when the wait ended
    cpu: dict[str, float]  # seconds during the burst, by process
    window: float  # seconds from just before the first submit to all Running seen
    workers_cpu: tuple[float, int]  # the workers' live processes: CPU seconds in the window, how many
    load: tuple[float, float]  # 1-minute load average at the start and end of the burst
    machine_events: int  # history events the machines' workflows gained during the burst
    machine_histories: list[HistoryFigures]
    agent_processes: int
    server: ServerOps  # the server's own counters during the burst
    workers: list[Interval]  # the workers' processes alive after the read-back (bench/burst_checks.py)
    passes: tuple[float, float] = (0.0, 0.0)  # scheduling passes in this process during the burst: count, seconds
    pauses: Pauses = field(default_factory=Pauses)  # the garbage collector's in this process during the burst
    steady: Steady | None = None  # the steady state after the burst (bench/steady.py)
    floor: Floor | None = None


async def measure(options: Options, root: Path) -> Burst:
    machines = Machines(count=options.machines, gpus=options.gpus)
    cluster = Cluster(
        root, machines, options.agents_per_process, options.services_apart, control_processes=options.controls
    )
    started = time.monotonic()
    try:
        client = await cluster.start()
        print(
            f"cluster up in {time.monotonic() - started:.1f} s ({cluster.agent_processes} agent processes)",
            file=sys.stderr,
        )
        idle = await idle_runs(client, options.idle, options.sleep)
        print(f"idle runs done; submitting {options.runs} runs", file=sys.stderr)
        before_machines = await machine_workflows(client)
        runs = [Run(name=f"run-{i:04d}") for i in range(options.runs)]
        metrics_port = cluster.server.metrics_port
        assert metrics_port is not None
        server_start = await settled(metrics_port)
        _, log_start = logged(cluster.server.log, 0)
        load_start, cpu_start, window = os.getloadavg()[0], cluster.cpu(), time.monotonic()
        workers_start, _ = cluster.workers_cpu()  # the fork servers' so far
        passes_start = scheduling_passes()
        gate = asyncio.Semaphore(SUBMIT_CONCURRENCY)
        with Pauses().counting() as pauses:
            submits = asyncio.gather(*(submit(client, r, options.sleep, gate) for r in runs))
            running = await wait_running(client, options.target, options.timeout)
            await submits
        cpu_end, window = cluster.cpu(), time.monotonic() - window
        cpu = {k: cpu_end[k] - cpu_start[k] for k in cpu_end}
        passes = tuple(end - start for start, end in zip(passes_start, scheduling_passes(), strict=True))
        server = between(server_start, await settled(metrics_port))
        server.logged, _ = logged(cluster.server.log, log_start)
        (workers_end, alive), load_end = cluster.workers_cpu(), os.getloadavg()[0]
        workers_cpu = (workers_end - workers_start, alive)
        print(f"{running} Running; reading back", file=sys.stderr)
        read_gate = asyncio.Semaphore(READ_CONCURRENCY)
        await asyncio.gather(*(read_back(client, r, read_gate) for r in runs))
        workers = await asyncio.to_thread(cluster.live_workers)  # after the read-back: the runs say where they are
        after_machines = await machine_workflows(client)
        gained = sum(after_machines[k] - before_machines.get(k, 0) for k in after_machines)
        histories = await machine_histories(client, sorted(after_machines))
        steady = None  # after every figure of the burst is taken, so that none of them changes
        if options.steady > 0:
            steady = await measure_steady(cluster, client, NAMESPACE, options.steady, options.settle)
    except BaseException:
        print(cluster.logs_tail(), file=sys.stderr)
        raise
    finally:
        await cluster.stop()
    return Burst(
        options,
        idle,
        runs,
        running,
        cpu,
        window,
        workers_cpu,
        (load_start, load_end),
        gained,
        histories,
        cluster.agent_processes,
        server,
        workers,
        (passes[0], passes[1]),
        pauses,
        steady,
    )


def scheduling_passes() -> tuple[float, float]:
    """The scheduling passes this process ran so far, and their seconds (none when the scheduler runs apart)."""
    count = REGISTRY.get_sample_value("astraeus_scheduler_pass_seconds_count") or 0.0
    return count, REGISTRY.get_sample_value("astraeus_scheduler_pass_seconds_sum") or 0.0


async def bench(options: Options) -> list[str]:
    # SIGTERM (timeout, kill) cancels the benchmark, so that every process it started is ended.
    this = asyncio.current_task()
    assert this is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    results = []
    for pair in range(1, options.pairs + 1):
        data_dir = options.data_dir
        if options.pairs > 1:
            print(f"pair {pair} of {options.pairs}", file=sys.stderr)
            data_dir = data_dir / f"pair-{pair}" if data_dir is not None else None  # a fresh cluster each time
        results.append(await burst_and_floor(options, data_dir))
        if options.pairs > 1:  # kept in the output should a later pair fail
            label, value = pair_row(pair, pair_figures(results[-1]))
            print(f"{label}: {value}", file=sys.stderr)
    result = results[-1]
    if options.json_path is not None:
        data = figures(result)
        if options.pairs > 1:
            data["pairs"] = [pair_figures(r) for r in results]
        options.json_path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    out = lines(result) + (pair_lines(results) if options.pairs > 1 else [])
    broken = [f"pair {i}: {n}" for i, r in enumerate(results, 1) if (n := check(r.runs, r.workers, GPUS).broken)]
    if broken:  # the figures first, then a failure: `make bench-burst` exits 1
        print("\n".join(out))
        sys.stdout.flush()
        raise InvariantsBroken(f"invariants broken ({', '.join(broken)}): see the table")
    return out


class InvariantsBroken(Exception):
    """A burst started a worker twice, gave a GPU to two, or lost a run (bench/burst_checks.py)."""


async def burst_and_floor(options: Options, data_dir: Path | None) -> Burst:
    """One burst (its cluster's files kept in `data_dir`, if given), then its floor on a fresh server."""
    if data_dir is not None:
        data_dir.mkdir(parents=True, exist_ok=True)
        result = await measure(options, data_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="astraeus-burst-") as root:
            result = await measure(options, Path(root))
    if options.floor:
        floor_runs = options.floor_runs if options.floor_runs is not None else options.target
        print(f"the floor: {floor_runs} bare workflows on a fresh dev server", file=sys.stderr)
        result.floor = await run_floor(data_dir, floor_runs, SUBMIT_CONCURRENCY, options.timeout)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, help="runs in the burst (default 200; with --overload 2 x machines x gpus)")
    p.add_argument("--machines", type=int, default=32, help="machines, each a real agent (default 32)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs each machine declares (default 8)")
    p.add_argument("--overload", action="store_true", help="twice as many runs as GPUs, unless --runs says")
    p.add_argument("--sleep", type=float, default=3000, help="seconds each worker sleeps (default 3000)")
    p.add_argument("--idle", type=int, default=5, help="runs submitted one at a time on the idle cluster first (5)")
    p.add_argument(
        "--agents-per-process", type=int, help="agents in each agent process (default: all in one; 1: one each)"
    )
    p.add_argument("--services-apart", action="store_true", help="control plane and scheduler in their own processes")
    p.add_argument(
        "--control-processes",
        type=int,
        default=1,
        help="`astraeus control` processes (default 1; more: apart)",
    )
    p.add_argument(
        "--steady", type=float, default=60, help="seconds of steady state measured after the burst (60; 0: none)"
    )
    p.add_argument("--settle", type=float, default=20, help="seconds waited before the steady state's window (20)")
    p.add_argument("--no-floor", dest="floor", action="store_false", help="skip the floor")
    p.add_argument(
        "--pairs", type=int, default=1, help="bursts, each followed by its floor: each ratio and their median (1)"
    )
    p.add_argument("--floor-runs", type=int, help="bare workflows in the floor (default: min(runs, machines x gpus))")
    p.add_argument("--timeout", type=float, default=900, help="give up waiting for all Running after this (900 s)")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the figures to this file")
    p.add_argument("--data-dir", type=Path, help="keep the cluster's files and logs here (default: a temporary dir)")
    return p


def options_from(args: argparse.Namespace) -> Options:
    if args.pairs < 1:
        raise SystemExit("python -m bench.burst: --pairs must be at least 1")
    if args.steady < 0 or args.settle < 0:
        raise SystemExit("python -m bench.burst: --steady and --settle must not be negative")
    runs = args.runs if args.runs is not None else (2 * args.machines * args.gpus if args.overload else 200)
    return Options(
        runs=runs,
        machines=args.machines,
        gpus=args.gpus,
        sleep=args.sleep,
        idle=args.idle,
        agents_per_process=args.agents_per_process or args.machines,
        services_apart=args.services_apart or args.control_processes > 1,
        controls=args.control_processes,
        floor=args.floor,
        floor_runs=args.floor_runs,
        timeout=args.timeout,
        json_path=args.json_path,
        data_dir=args.data_dir,
        pairs=args.pairs,
        steady=args.steady,
        settle=args.settle,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = options_from(parser().parse_args(argv))
    run_and_exit(bench(options), show_load=True)


if __name__ == "__main__":
    main()
