"""The fault-injection suite: `python -m bench.chaos [--runs N] [--machines M] [--gpus G] [--faults LIST]
[--baseline] [--restart-policy P] [--lease-ttl S] [--down S] [--timeout T] [--json FILE] [--data-dir DIR]`.

Starts the cluster as separate processes (`bench.cluster`: the Temporal dev server on a file database, `astraeus
control`, `astraeus scheduler`, and one `bench.agents` process per machine declaring G fake GPUs), all with a
`--settings` file that shortens the machines' lease. Submits N one-GPU runs at once (more than the GPUs, so they
queue), each a shell worker that writes its start and end in a journal outside Astraeus. Mid-burst it kill -9s, in
turn, the control plane, the scheduler, an agent restarted within its lease, an agent restarted after its lease
expired, and the Temporal server (restarted on the same database file), each once the cluster has resumed from the
one before. Then it waits until every run has ended (or `--timeout`), reads each one back, and checks: every run
ended or waits with a true reason, 0 runs lost, 0 workers started twice, 0 GPUs held by two workers at once; and
prints what each fault cost. Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.chaos_checks import Fault, Interval, RunRead, read_journal, worker_command
from bench.chaos_report import Outcome, outcome_lines
from bench.cluster import Cluster, Machines
from bench.common import run_and_exit
from workers.client import AstraeusClient
from workflows.contracts import SA_NAMESPACE
from workflows.domain.inventory import NodeState
from workflows.domain.spec import JobSpec, job_id, parse_spec

NAMESPACE = "chaos"
BASELINE_NAMESPACE = "baseline"
FAULTS = ("control", "scheduler", "agent-within-lease", "agent-after-lease", "temporal")
SUBMIT_CONCURRENCY = 50
READ_CONCURRENCY = 10
POLL_SECONDS = 0.5
AFTER_DOWN_SECONDS = 1.0  # an agent past its lease is started again this long after its machine is seen not Ready
RESUME_TIMEOUT = 120.0  # seconds to wait for the cluster to start a worker again after a restart


class ChecksFailed(Exception):
    """A check of the suite failed; the table above says which."""


@dataclass
class Options:
    runs: int = 200
    machines: int = 4
    gpus: int = 4
    sleep: tuple[float, float] = (3.0, 8.0)  # each worker sleeps between these, spread over the runs
    faults: tuple[str, ...] = FAULTS
    baseline: bool = False
    restart_policy: str = "OnFailure"
    lease_ttl: float = 10.0
    down: float = 1.0  # how long a killed process stays down (an agent past its lease: until its machine is not Ready)
    spacing: float = 3.0  # seconds between one fault's resumption and the next kill
    timeout: float = 900.0  # for the burst to settle after its last submit
    json_path: Path | None = None
    data_dir: Path | None = None

    @property
    def first_fault_after(self) -> int:
        """Workers started before the first kill: the burst is in full swing, with runs still waiting."""
        return min(self.machines * self.gpus, self.runs // 4)


@dataclass
class Burst:
    namespace: str
    submitted_at: float = 0.0
    settled_at: float | None = None  # every run's workflow closed
    submit_errors: list[str] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)


def spec_for(name: str, namespace: str, seconds: float, journal: Path, restart_policy: str = "OnFailure") -> JobSpec:
    """One worker of one GPU that journals its start and end."""
    group = {
        "name": "worker",
        "command": worker_command(seconds),
        "env": {"CHAOS_JOURNAL": str(journal)},
        "cpu": 0.1,
        "memory_bytes": 0,
        "gpus": 1,
        "restart_policy": restart_policy,
    }
    return parse_spec({"name": name, "namespace": namespace, "groups": [group]})


def seconds_for(index: int, sleep: tuple[float, float]) -> float:
    """Spread over [low, high] in a fixed, scrambled order, so that workers end at different times."""
    low, high = sleep
    return round(low + (high - low) * ((index * 37) % 101) / 100, 1)


def names(options: Options) -> list[str]:
    return [f"run-{i:04d}" for i in range(options.runs)]


# ---- the journal and the machines' files ----------------------------------------------------------------------


def journal_intervals(root: Path, journal: Path) -> list[Interval]:
    """The journal, each worker without an end line ended when its attempt's exit file was written."""
    exits = {}
    for exit_file in (root / "machines").glob("*/tasks/*/exit"):
        node, slug = exit_file.parts[-4], exit_file.parts[-2]
        try:
            exits[(node, slug)] = exit_file.stat().st_mtime
        except OSError:
            continue
    text = journal.read_text() if journal.exists() else ""
    return read_journal(text, exits)


def unjournaled(root: Path, intervals: list[Interval], namespace: str) -> list[str]:
    """Attempts the machines started (the process runtime wrote their worker's pid) with no start line: every start
    of a worker process must be in the journal, or the checks above could miss one."""
    journaled = {(i.node, i.slug) for i in intervals}
    started = {(f.parts[-4], f.parts[-2]) for f in (root / "machines").glob(f"*/tasks/{namespace}.*/pid")}
    return [f"{slug} on {node}" for node, slug in sorted(started - journaled)]


def of_namespace(intervals: list[Interval], namespace: str) -> list[Interval]:
    return [i for i in intervals if i.run.startswith(f"{namespace}/")]


# ---- the burst ----------------------------------------------------------------------------------------------------


async def submit_all(client: AstraeusClient, options: Options, burst: Burst, journal: Path) -> None:
    gate = asyncio.Semaphore(SUBMIT_CONCURRENCY)

    async def one(index: int, name: str) -> None:
        async with gate:
            try:
                seconds = seconds_for(index, options.sleep)
                await client.submit(spec_for(name, burst.namespace, seconds, journal, options.restart_policy))
            except Exception as error:  # reported: a run whose submit failed was never ours to lose
                burst.submit_errors.append(f"{name}: {error}")

    burst.submitted_at = time.time()
    await asyncio.gather(*(one(i, n) for i, n in enumerate(names(options))))


async def closed_count(client: AstraeusClient, namespace: str) -> int | None:
    """Runs of the namespace whose workflow closed; None while Temporal does not answer (it is being restarted)."""
    query = f'{SA_NAMESPACE}="{namespace}" AND ExecutionStatus!="Running"'
    try:
        return (await client.temporal.count_workflows(query)).count
    except Exception:
        return None


async def wait_settled(client: AstraeusClient, burst: Burst, total: int, deadline: float) -> None:
    reported = time.monotonic()
    while time.monotonic() < deadline:
        closed = await closed_count(client, burst.namespace)
        if closed is not None and closed >= total:
            burst.settled_at = time.time()
            return
        if time.monotonic() - reported > 15:
            reported = time.monotonic()
            print(f"  {burst.namespace}: {closed} of {total} runs ended", file=sys.stderr)
        await asyncio.sleep(POLL_SECONDS)


async def run_burst(
    cluster: Cluster, client: AstraeusClient, options: Options, namespace: str, faults: Sequence[str]
) -> Burst:
    burst = Burst(namespace)
    journal = cluster.root / "journal"
    submitting = asyncio.ensure_future(submit_all(client, options, burst, journal))
    injector = Injector(cluster, client, options, burst, journal)
    try:
        await injector.inject(faults)
        await submitting
        await wait_settled(client, burst, options.runs - len(burst.submit_errors), time.monotonic() + options.timeout)
    finally:
        submitting.cancel()
    return burst


# ---- the faults ---------------------------------------------------------------------------------------------------


class Injector:
    """Kills and restarts the cluster's processes, one fault at a time, each once the cluster resumed from the last."""

    def __init__(self, cluster: Cluster, client: AstraeusClient, options: Options, burst: Burst, journal: Path) -> None:
        self.cluster = cluster
        self.client = client
        self.options = options
        self.burst = burst
        self.journal = journal

    def intervals(self) -> list[Interval]:
        return of_namespace(journal_intervals(self.cluster.root, self.journal), self.burst.namespace)

    async def inject(self, faults: Sequence[str]) -> None:
        if not faults:
            return
        deadline = time.monotonic() + self.options.timeout
        while len(self.intervals()) < self.options.first_fault_after:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"fewer than {self.options.first_fault_after} workers started in {self.options.timeout:g} s"
                )
            await asyncio.sleep(POLL_SECONDS)
        for name in faults:
            fault = await self.one(name)
            self.burst.faults.append(fault)
            print(f"  {name}: {fault.note or 'restarted'}", file=sys.stderr)
            await asyncio.sleep(self.options.spacing)

    async def one(self, name: str) -> Fault:
        agents = self.cluster.agent_names
        process = {"agent-within-lease": agents[0], "agent-after-lease": agents[min(1, len(agents) - 1)]}.get(
            name, name
        )
        node = f"m-{int(process.removeprefix('agents-')):03d}" if process.startswith("agents-") else None
        holder = await self.holder(node) if node else None
        seen = self.intervals()  # just before the kill
        fault = Fault(name, process, node, killed=time.time(), lease_ttl=self.options.lease_ttl)
        fault.waiting_at_kill = self.options.runs - len({i.run for i in seen})
        fault.alive_at_kill = sum(1 for i in seen if i.end is None and (node is None or i.node == node))
        if name == "temporal":
            await asyncio.to_thread(self.restart_server)
        else:
            self.cluster.kill(process)
            if name == "agent-after-lease":
                await self.until_down(fault)
            else:
                await asyncio.sleep(self.options.down)
            self.cluster.respawn(process)
        fault.restarted = time.time()
        await self.until_resumed(fault, holder)
        return fault

    def restart_server(self) -> None:
        """kill -9 the dev server by its PID, then start it again on the same database file and port."""
        server = self.cluster.server
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        server.stop()  # releases the data dir's lock
        time.sleep(self.options.down)
        server.start()

    async def holder(self, node: str) -> str | None:
        try:
            return next((n.holder for n in await self.client.nodes() if n.name == node), None)
        except Exception:
            return None

    async def until_down(self, fault: Fault) -> None:
        """Until the machine's lease expired (it is no longer Ready), then a moment more."""
        deadline = time.monotonic() + 3 * self.options.lease_ttl + 60
        while time.monotonic() < deadline:
            try:
                state = next((n.state for n in await self.client.nodes() if n.name == fault.node), None)
            except Exception:
                state = None
            if state is not None and state != NodeState.READY:
                await asyncio.sleep(AFTER_DOWN_SECONDS)
                return
            await asyncio.sleep(POLL_SECONDS)
        fault.note = f"machine {fault.node} still Ready {3 * self.options.lease_ttl + 60:g} s after its agent died; "

    async def until_resumed(self, fault: Fault, holder: str | None) -> None:
        """Until a worker starts after the restart (on its machine, for an agent), and an agent's machine is Ready
        under a new agent; notes what did not happen."""
        deadline = time.monotonic() + RESUME_TIMEOUT
        while time.monotonic() < deadline:
            if fault.node is not None and fault.ready_again is None:
                await self.check_ready(fault, holder)
            process = self.cluster.process(fault.process) if fault.process != "temporal" else None
            if process is not None and process.poll() is not None:
                fault.note += f"the restarted {fault.process} exited with code {process.returncode}; "
                return
            started = any(i.start > (fault.restarted or 0) and fault.node in (None, i.node) for i in self.intervals())
            if started and (fault.node is None or fault.ready_again is not None):
                return
            await asyncio.sleep(POLL_SECONDS)
        if fault.node is not None and fault.ready_again is None:
            fault.note += f"machine {fault.node} not Ready again under a new agent in {RESUME_TIMEOUT:g} s; "
        fault.note += f"no worker started{f' on {fault.node}' if fault.node else ''} in {RESUME_TIMEOUT:g} s"

    async def check_ready(self, fault: Fault, holder: str | None) -> None:
        try:
            view = next((n for n in await self.client.nodes() if n.name == fault.node), None)
        except Exception:
            return
        if view is not None and view.state == NodeState.READY and view.holder not in (None, holder):
            fault.ready_again = time.time()
            killed = datetime.fromtimestamp(fault.killed, UTC)
            fault.lease_expired = any(e.at > killed and e.state != NodeState.READY for e in view.history)


# ---- reading back -------------------------------------------------------------------------------------------------


async def read_back(client: AstraeusClient, namespace: str, name: str, gate: asyncio.Semaphore) -> RunRead:
    read = RunRead(f"{namespace}/{name}")
    async with gate:
        for attempt in range(3):
            try:
                described = await client.describe(namespace, name)
                execution = await client.temporal.get_workflow_handle(job_id(namespace, name)).describe()
                break
            except Exception as error:
                read.error = f"{type(error).__name__}: {error}"
                await asyncio.sleep(attempt + 1)
        else:
            return read
    read.error = None
    read.closed = execution.close_time is not None
    status = described.status
    read.state, read.code, read.reason = status.state, status.code, status.reason
    for task in described.tasks:
        worker = task.status
        read.worker_state, read.worker_code, read.worker_reason = worker.state, worker.code, worker.reason
    return read


async def read_runs(client: AstraeusClient, options: Options, burst: Burst) -> list[RunRead]:
    gate = asyncio.Semaphore(READ_CONCURRENCY)
    failed = {e.split(":", 1)[0] for e in burst.submit_errors}
    ours = [n for n in names(options) if n not in failed]
    return list(await asyncio.gather(*(read_back(client, burst.namespace, n, gate) for n in ours)))


# ---- the whole ------------------------------------------------------------------------------------------------------


def settings_file(root: Path, options: Options) -> Path:
    """A short lease (so that "restarted after its lease expired" is quick); the restart back-off stays the spec's
    (10 s): a worker lost with its machine is run again no sooner, and one that exited 0 meanwhile is not at all
    when its machine comes back within that time."""
    path = root / "settings.yaml"
    path.write_text(f"node_lease_ttl_seconds: {options.lease_ttl:g}\n")
    return path


async def measure(options: Options, root: Path) -> Outcome:
    machines = Machines(count=options.machines, gpus=options.gpus)
    cluster = Cluster(root, machines, 1, services_apart=True, settings=settings_file(root, options))
    began = time.monotonic()
    try:
        client = await cluster.start()
        print(f"cluster up in {time.monotonic() - began:.1f} s", file=sys.stderr)
        baseline = None
        if options.baseline:
            print(f"baseline: {options.runs} runs, no fault", file=sys.stderr)
            baseline = await run_burst(cluster, client, options, BASELINE_NAMESPACE, ())
        print(f"chaos: {options.runs} runs, faults {', '.join(options.faults) or 'none'}", file=sys.stderr)
        burst = await run_burst(cluster, client, options, NAMESPACE, options.faults)
        print("reading back", file=sys.stderr)
        runs = await read_runs(client, options, burst)
        intervals = of_namespace(journal_intervals(root, root / "journal"), NAMESPACE)
        missing = unjournaled(root, intervals, NAMESPACE)
    except BaseException:
        print(cluster.logs_tail(), file=sys.stderr)
        raise
    finally:
        await cluster.stop()
    return Outcome(
        options=asdict(options) | {"json_path": None, "data_dir": None},
        burst_submitted_at=burst.submitted_at,
        burst_settled_at=burst.settled_at,
        baseline_seconds=(
            baseline.settled_at - baseline.submitted_at if baseline and baseline.settled_at is not None else None
        ),
        submit_errors=burst.submit_errors,
        faults=burst.faults,
        runs=runs,
        intervals=intervals,
        gpus_per_worker=1,
        unjournaled=missing,
    )


async def bench(options: Options) -> None:
    this = asyncio.current_task()
    assert this is not None
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, this.cancel)
    if options.data_dir is not None:
        options.data_dir.mkdir(parents=True, exist_ok=True)
        outcome = await measure(options, options.data_dir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="astraeus-chaos-") as root:
            outcome = await measure(options, Path(root))
    lines, figures, failures = outcome_lines(outcome)
    if options.json_path is not None:
        options.json_path.write_text(json.dumps(figures, indent=2, default=str) + "\n")
    print("\n".join(lines))
    sys.stdout.flush()
    if failures:
        raise ChecksFailed(f"{len(failures)} check(s) failed: {'; '.join(failures)}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200, help="one-GPU runs in the burst (default 200)")
    p.add_argument("--machines", type=int, default=4, help="machines, one agent process each (default 4)")
    p.add_argument("--gpus", type=int, default=4, help="GPUs each machine declares (default 4)")
    p.add_argument("--sleep", default="3-8", help="seconds each worker sleeps, LOW-HIGH (default 3-8)")
    p.add_argument(
        "--faults", default=",".join(FAULTS), help=f"in this order, comma-separated (default all: {','.join(FAULTS)})"
    )
    p.add_argument("--baseline", action="store_true", help="first the same burst without faults, to compare")
    p.add_argument(
        "--restart-policy", choices=["OnFailure", "Never"], default="OnFailure", help="the workers' (OnFailure)"
    )
    p.add_argument("--lease-ttl", type=float, default=10.0, help="the machines' lease, seconds (default 10)")
    p.add_argument("--down", type=float, default=1.0, help="seconds a killed process stays down (default 1)")
    p.add_argument("--spacing", type=float, default=3.0, help="seconds between a fault's resumption and the next")
    p.add_argument("--timeout", type=float, default=900, help="for the burst to settle after its submits (900 s)")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the figures to this file")
    p.add_argument("--data-dir", type=Path, help="keep the cluster's files, logs and journal here")
    return p


def options_from(args: argparse.Namespace) -> Options:
    low, _, high = args.sleep.partition("-")
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise SystemExit(f"--faults: unknown {', '.join(unknown)} (known: {', '.join(FAULTS)})")
    if args.runs <= args.machines * args.gpus:
        print("warning: no more runs than GPUs: nothing will queue", file=sys.stderr)
    return Options(
        runs=args.runs,
        machines=args.machines,
        gpus=args.gpus,
        sleep=(float(low), float(high or low)),
        faults=faults,
        baseline=args.baseline,
        restart_policy=args.restart_policy,
        lease_ttl=args.lease_ttl,
        down=args.down,
        spacing=args.spacing,
        timeout=args.timeout,
        json_path=args.json_path,
        data_dir=args.data_dir,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = options_from(parser().parse_args(argv))
    run_and_exit(bench(options), "bench.chaos", show_load=True)


if __name__ == "__main__":
    main()
