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

The longer faults of issue 39 (`bench.chaos_faults`, judged by `bench.chaos_judge`) run only when `--faults` names
them: `partition` (one agent cut off from Temporal through a proxy), `temporal-away` (the server down longer than a
lease), `two-schedulers` (a second scheduler beside the first), `gang-barrier-kill` (an agent killed while a gang's
members wait at the barrier), `full-disk` (an agent's data dir full while its workers exit); each with its checks
and a line of figures.
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
from dataclasses import asdict
from pathlib import Path

from bench.chaos_checks import RunRead
from bench.chaos_faults import LongerFaults, Setup
from bench.chaos_inject import (
    BASELINE_NAMESPACE,
    FAULTS,
    KNOWN_FAULTS,
    NAMESPACE,
    POLL_SECONDS,
    Burst,
    Options,
    closed_count,
    journal_intervals,
    names,
    of_namespace,
    seconds_for,
    spec_for,
    unjournaled,
)
from bench.chaos_judge import GANG_RUN, NEW_FAULTS
from bench.chaos_report import Outcome, outcome_lines
from bench.cluster import Cluster, Machines
from bench.common import run_and_exit
from workers.client import AstraeusClient
from workflows.domain.spec import job_id

SUBMIT_CONCURRENCY = 50
READ_CONCURRENCY = 10


class ChecksFailed(Exception):
    """A check of the suite failed; the table above says which."""


# ---- the burst ----------------------------------------------------------------------------------------------------


async def submit_all(client: AstraeusClient, options: Options, burst: Burst, journal: Path) -> None:
    gate = asyncio.Semaphore(SUBMIT_CONCURRENCY)

    async def one(index: int, name: str) -> None:
        async with gate:
            try:
                seconds = seconds_for(index, options.sleep)
                policy = options.restart_policy
                if policy == "Mixed":  # every other run restart-Never
                    policy = ("OnFailure", "Never")[index % 2]
                await client.submit(spec_for(name, burst.namespace, seconds, journal, policy))
            except Exception as error:  # reported: a run whose submit failed was never ours to lose
                burst.submit_errors.append(f"{name}: {error}")

    burst.submitted_at = time.time()
    await asyncio.gather(*(one(i, n) for i, n in enumerate(names(options))))


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
    cluster: Cluster,
    client: AstraeusClient,
    options: Options,
    namespace: str,
    faults: Sequence[str],
    setup: Setup | None = None,
) -> Burst:
    burst = Burst(namespace)
    journal = cluster.root / "journal"
    submitting = asyncio.ensure_future(submit_all(client, options, burst, journal))
    injector = LongerFaults(cluster, client, options, burst, journal, setup=setup or Setup())
    try:
        await injector.inject(faults)
        await submitting
        await wait_settled(client, burst, options.runs - len(burst.submit_errors), time.monotonic() + options.timeout)
    finally:
        submitting.cancel()
    return burst


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
    read.closed_at = execution.close_time.timestamp() if execution.close_time is not None else None
    status = described.status
    read.state, read.code, read.reason = status.state, status.code, status.reason
    read.history = [(e.at.timestamp(), e.code, e.reason) for e in described.history]
    for task in described.tasks:
        worker = task.status
        read.worker_state, read.worker_code, read.worker_reason = worker.state, worker.code, worker.reason
        read.history += [(e.at.timestamp(), e.code, e.reason) for e in task.history]
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
    setup = await Setup.before(options, cluster)
    try:
        client = await cluster.start()
        print(f"cluster up in {time.monotonic() - began:.1f} s", file=sys.stderr)
        baseline = None
        if options.baseline:
            print(f"baseline: {options.runs} runs, no fault", file=sys.stderr)
            baseline = await run_burst(cluster, client, options, BASELINE_NAMESPACE, ())
        print(f"chaos: {options.runs} runs, faults {', '.join(options.faults) or 'none'}", file=sys.stderr)
        burst = await run_burst(cluster, client, options, NAMESPACE, options.faults, setup)
        print("reading back", file=sys.stderr)
        runs = await read_runs(client, options, burst)
        gang = []
        if "gang-barrier-kill" in options.faults:
            gang.append(await read_back(client, NAMESPACE, GANG_RUN, asyncio.Semaphore(1)))
        observed_until = time.time()
        intervals = of_namespace(journal_intervals(root, root / "journal"), NAMESPACE)
        missing = unjournaled(root, intervals, NAMESPACE)
    except BaseException:
        print(cluster.logs_tail(), file=sys.stderr)
        raise
    finally:
        await cluster.stop()
        await setup.close()
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
        extra_runs=gang,
        observed_until=observed_until,
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
        "--faults",
        default=",".join(FAULTS),
        help=f"in this order, comma-separated (default: {','.join(FAULTS)}; also {','.join(NEW_FAULTS)})",
    )
    p.add_argument("--baseline", action="store_true", help="first the same burst without faults, to compare")
    p.add_argument(
        "--restart-policy",
        choices=["OnFailure", "Never", "Mixed"],
        default="OnFailure",
        help="the workers' (OnFailure; Mixed: every other run Never)",
    )
    p.add_argument("--lease-ttl", type=float, default=10.0, help="the machines' lease, seconds (default 10)")
    p.add_argument("--down", type=float, default=1.0, help="seconds a killed process stays down (default 1)")
    p.add_argument("--spacing", type=float, default=3.0, help="seconds between a fault's resumption and the next")
    p.add_argument("--timeout", type=float, default=900, help="for the burst to settle after its submits (900 s)")
    p.add_argument("--partition-seconds", type=float, default=45, help="partition: how long the cut lasts (45)")
    p.add_argument("--away-seconds", type=float, default=70, help="temporal-away: how long the server is down (70)")
    p.add_argument("--overlap-seconds", type=float, default=30, help="two-schedulers: how long both run (30)")
    p.add_argument("--full-seconds", type=float, default=20, help="full-disk: how long the disk stays full (20)")
    p.add_argument("--gang-seconds", type=float, default=20, help="gang-barrier-kill: each member's sleep (20)")
    p.add_argument("--gang-down", type=float, default=15, help="gang-barrier-kill: the agent down after Down (15)")
    p.add_argument("--fault-after", type=int, help="workers started before the first fault (min(M x G, N / 4))")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the figures to this file")
    p.add_argument("--data-dir", type=Path, help="keep the cluster's files, logs and journal here")
    return p


def options_from(args: argparse.Namespace) -> Options:
    low, _, high = args.sleep.partition("-")
    faults = tuple(f for f in args.faults.split(",") if f)
    unknown = [f for f in faults if f not in KNOWN_FAULTS]
    if unknown:
        raise SystemExit(f"--faults: unknown {', '.join(unknown)} (known: {', '.join(KNOWN_FAULTS)})")
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
        partition_seconds=args.partition_seconds,
        away_seconds=args.away_seconds,
        overlap_seconds=args.overlap_seconds,
        full_seconds=args.full_seconds,
        gang_seconds=args.gang_seconds,
        gang_down=args.gang_down,
        fault_after=args.fault_after,
    )


def main(argv: Sequence[str] | None = None) -> None:
    options = options_from(parser().parse_args(argv))
    run_and_exit(bench(options), "bench.chaos", show_load=True)


if __name__ == "__main__":
    main()
