"""The chaos suite's options and its fault injector: kill -9 and restart of each process in turn (`Injector`), and,
through `bench.chaos_faults`, the longer faults (a partition, Temporal away, two schedulers, a kill at a gang's
barrier, a full disk). `bench.chaos` runs the burst around them."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from bench.chaos_checks import Fault, Interval, read_journal, worker_command
from bench.chaos_judge import GANG_RUN, NEW_FAULTS
from bench.cluster import Cluster
from workers.client import AstraeusClient
from workflows.contracts import SA_NAMESPACE
from workflows.domain.inventory import NodeState
from workflows.domain.spec import JobSpec, parse_spec

NAMESPACE = "chaos"
BASELINE_NAMESPACE = "baseline"
FAULTS = ("control", "scheduler", "agent-within-lease", "agent-after-lease", "temporal")  # the default: every one
KNOWN_FAULTS = FAULTS + NEW_FAULTS  # the longer ones (bench.chaos_faults) only when named
POLL_SECONDS = 0.5
AFTER_DOWN_SECONDS = 1.0  # an agent past its lease is started again this long after its machine is seen not Ready
RESUME_TIMEOUT = 120.0  # seconds to wait for the cluster to start a worker again after a restart


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
    # The longer faults (bench.chaos_faults): each one's length.
    partition_seconds: float = 45.0  # `partition`: one agent cut off from Temporal
    away_seconds: float = 70.0  # `temporal-away`: the server down, longer than a lease
    overlap_seconds: float = 30.0  # `two-schedulers`: a second scheduler (and control plane) beside the first
    full_seconds: float = 20.0  # `full-disk`: an agent's data dir full, longer than the longest worker
    gang_seconds: float = 20.0  # `gang-barrier-kill`: how long each gang member sleeps
    gang_down: float = 15.0  # `gang-barrier-kill`: how long the killed agent stays down after its machine is Down
    fault_after: int | None = None  # workers started before the first fault (None: `first_fault_after`'s rule)

    @property
    def first_fault_after(self) -> int:
        """Workers started before the first kill: the burst is in full swing, with runs still waiting."""
        if self.fault_after is not None:
            return self.fault_after
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


async def closed_count(client: AstraeusClient, namespace: str) -> int | None:
    """Runs of the namespace whose workflow closed; None while Temporal does not answer (it is being restarted)."""
    query = f'{SA_NAMESPACE}="{namespace}" AND ExecutionStatus!="Running"'
    try:
        return (await client.temporal.count_workflows(query)).count
    except Exception:
        return None


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
        fault = self.begin(name, process, node)
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

    def begin(self, name: str, process: str, node: str | None) -> Fault:
        """The fault, as it hits now: how many runs still wait, how many workers live (on its machine)."""
        seen = self.intervals()  # just before the kill
        fault = Fault(name, process, node, killed=time.time(), lease_ttl=self.options.lease_ttl)
        fault.waiting_at_kill = self.options.runs - len({i.run for i in seen if not i.run.endswith(f"/{GANG_RUN}")})
        fault.alive_at_kill = sum(1 for i in seen if i.end is None and (node is None or i.node == node))
        return fault

    def restart_server(self, away: bool = False) -> None:
        """kill -9 the dev server by its PID, then start it again on the same database file and port (after `--down`;
        `away`: after `--away-seconds`)."""
        server = self.cluster.server
        assert server.process is not None
        server.process.kill()
        server.process.wait()
        server.stop()  # releases the data dir's lock
        time.sleep(self.options.away_seconds if away else self.options.down)
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
