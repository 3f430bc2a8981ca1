"""A benchmark's cluster, process by process: the embedded default's Temporal dev server, the control plane and
the scheduler (in this process, or as `astraeus control` / `astraeus scheduler` processes), and M machines whose
agents run in processes of their own (`bench.agents`, K agents each). Every process it starts, the workers'
included, it ends by PID; it reads each one's CPU time from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from temporalio.api.enums.v1 import TaskQueueType
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client

from activities.agent.runtime.process import ProcessRuntime
from activities.scheduler_link import SchedulerDoor
from bench.agents import machine_name
from bench.chaos_checks import Interval
from bench.common import children_of, own_cpu_seconds, pid_cpu_seconds, proc_stat, wait_for_machines
from workers.agent_process import Part
from workers.client import AstraeusClient
from workers.connect import TEMPORAL_NAMESPACE, connect
from workers.devserver import DevServer, free_port
from workers.embedded import shut_down
from workers.services import ControlWorker, scheduler_worker
from workflows.contracts import SCHEDULER_TASK_QUEUE
from workflows.domain.settings import Settings

PR_SET_CHILD_SUBREAPER = 36
ROOT = Path(__file__).resolve().parents[1]  # the repository: `python -m bench.agents` runs from here
STOP_WAIT_SECONDS = 10.0


@dataclass(frozen=True)
class Machines:
    count: int
    gpus: int
    gpu_model: str = "H100-80GB"
    cpus: float = 64.0
    memory_bytes: int = 64 * 2**30

    @property
    def declared(self) -> str:
        return f"{self.gpus}x{self.gpu_model}"


def become_subreaper() -> bool:
    """Orphans of our children (the workers' shims, once their agent's process ended) become ours, so that we can
    reap them by PID instead of leaving zombies to an init that may not reap."""
    try:
        return bool(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


class Cluster:
    def __init__(
        self,
        root: Path,
        machines: Machines,
        agents_per_process: int,
        services_apart: bool,
        settings: Path | None = None,
        control_processes: int = 1,
    ) -> None:
        self.root = root
        self.machines = machines
        self.agents_per_process = max(1, min(agents_per_process, machines.count))
        self.services_apart = services_apart or control_processes > 1
        self.control_processes = control_processes  # `astraeus control` processes (services apart)
        self.settings = settings  # a --settings YAML for every process (services apart only; None: the defaults)
        self.server = DevServer(root / "temporal", port=free_port(), ui_port=None, metrics_port=free_port())
        self.client: Client | None = None
        self.services: dict[str, subprocess.Popen[bytes]] = {}  # control, scheduler (--services-apart)
        self.agents: list[subprocess.Popen[bytes]] = []
        self.workers: list[Part] = []  # control plane and scheduler in this process
        self._running: list[asyncio.Task[None]] = []
        self.commands: dict[str, list[str]] = {}  # each process's arguments, by name, to start it again
        self.agent_temporal: dict[str, str] = {}  # an agents' process's Temporal address, by name, if not the server's

    @property
    def agent_processes(self) -> int:
        return math.ceil(self.machines.count / self.agents_per_process)

    @property
    def machine_dirs(self) -> list[Path]:
        return [self.root / "machines" / machine_name("m", i) for i in range(self.machines.count)]

    async def start(self) -> AstraeusClient:
        become_subreaper()
        await asyncio.to_thread(self.server.start)
        self.client = await connect(self.server.address, wait=timedelta(seconds=30))
        given = ["--settings", str(self.settings)] if self.settings is not None else []
        control_build = None  # the build of the control plane's worker in this process, if it runs here
        if self.services_apart:
            door = f"127.0.0.1:{free_port()}"  # the scheduler's, the same after a restart
            controls = ["control", *(f"control-{i}" for i in range(1, self.control_processes))]
            for name, flag in [*((c, "--scheduler") for c in controls), ("scheduler", "--listen")]:
                service = name.partition("-")[0]
                args = ["-m", "workers.cli", service, "--temporal", self.address, flag, door, *given]
                self.services[name] = self._spawn(name, *args)
        else:
            if self.settings is not None:
                raise ValueError("settings from a file need the services apart")
            scheduler_door = SchedulerDoor("127.0.0.1:0")
            control = ControlWorker(self.client, Settings(), scheduler_door)
            control_build = control.build_id
            self._run(control)
            self._run(await scheduler_worker(self.client, scheduler_door))
        for first in range(0, self.machines.count, self.agents_per_process):
            count = min(self.agents_per_process, self.machines.count - first)
            temporal = self.agent_temporal.get(f"agents-{first}", self.address)
            flags = ["--temporal", temporal, "--data-dir", str(self.root / "machines"), "--prefix", "m"]
            flags += ["--first", str(first), "--count", str(count), "--gpus", self.machines.declared]
            flags += ["--cpus", f"{self.machines.cpus:g}", "--memory-bytes", str(self.machines.memory_bytes)]
            flags += given
            self.agents.append(self._spawn(f"agents-{first}", "-m", "bench.agents", *flags))
        client = AstraeusClient(self.client, control_build=control_build)
        await wait_for_poller(self.client, SCHEDULER_TASK_QUEUE, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY)
        await wait_for_machines(client, self.machines.count, timeout=60 + self.machines.count)
        return client

    @property
    def address(self) -> str:
        return self.server.address

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        self.commands[name] = list(args)
        with (self.root / f"{name}.log").open("ab") as log:
            return subprocess.Popen(
                [sys.executable, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def kill(self, name: str) -> None:
        """kill -9 a process this cluster started (`control`, `scheduler`, `agents-<first>`), and reap it."""
        process = self.process(name)
        if process.poll() is None:
            process.kill()
        process.wait()

    def respawn(self, name: str) -> subprocess.Popen[bytes]:
        """Start a process again as it was first started (its log goes on)."""
        process = self._spawn(name, *self.commands[name])
        if name in self.services:
            self.services[name] = process
        else:
            self.agents[self.agent_names.index(name)] = process
        return process

    def add_services(self, suffix: str) -> tuple[str, str]:
        """A second scheduler (its own door) and a control plane that calls it, beside the first ones, as a rolling
        update starts them (services apart): their names, `control<suffix>` and `scheduler<suffix>`."""
        door = f"127.0.0.1:{free_port()}"
        control, scheduler = f"control{suffix}", f"scheduler{suffix}"
        common = ["--temporal", self.address, *(["--settings", str(self.settings)] if self.settings else [])]
        self.services[scheduler] = self._spawn(scheduler, "-m", "workers.cli", "scheduler", "--listen", door, *common)
        self.services[control] = self._spawn(control, "-m", "workers.cli", "control", "--scheduler", door, *common)
        return control, scheduler

    def replace(self, old: str, new: str) -> None:
        """End the service `old` (SIGTERM, as an update does) and call `new` by its name from now on."""
        end_process(self.services[old])
        self.services[old] = self.services.pop(new)
        self.commands[old] = self.commands.pop(new)

    def process(self, name: str) -> subprocess.Popen[bytes]:
        return self.services[name] if name in self.services else self.agents[self.agent_names.index(name)]

    @property
    def agent_names(self) -> list[str]:
        return [f"agents-{first}" for first in range(0, self.machines.count, self.agents_per_process)]

    def _run(self, worker: Part) -> None:
        self.workers.append(worker)
        self._running.append(asyncio.ensure_future(worker.run()))

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: this process (the client, and the control plane and scheduler unless apart), the
        control plane and scheduler processes, the agents' processes, the dev server."""
        return {
            "this": own_cpu_seconds(),
            "services": sum(pid_cpu_seconds(p.pid) for p in self.services.values()),
            "agents": sum(pid_cpu_seconds(p.pid) for p in self.agents),
            "server": pid_cpu_seconds(self.server.process.pid if self.server.process else None),
        }

    def workers_cpu(self) -> tuple[float, int]:
        """CPU seconds of the workers' processes that live now (each shim, and what it reaped; the agents' fork
        servers, which forked the shims, counted with them), and how many shims."""
        servers = children_of({p.pid for p in self.agents})
        shims = children_of(set(servers))
        seconds = sum(pid_cpu_seconds(pid) for pid in servers) + sum(pid_cpu_seconds(p, children=True) for p in shims)
        return seconds, len(shims)

    def live_workers(self) -> list[Interval]:
        """The workers' processes alive now (each shim's children), as their environment names them: run,
        worker, attempt, machine and GPUs (`CUDA_VISIBLE_DEVICES`)."""
        shims = children_of(set(children_of({p.pid for p in self.agents})))
        return [worker for pid in children_of(set(shims)) if (worker := read_worker(pid)) is not None]

    def logs_tail(self, lines: int = 20) -> str:
        """The end of each process's log, for a failure's report."""
        text = []
        for log in [*sorted(self.root.glob("*.log")), self.server.log]:
            with contextlib.suppress(OSError):
                tail = log.read_text(errors="replace").splitlines()[-lines:]
                text += [f"--- {log.name}", *tail]
        return "\n".join(text)

    async def stop(self) -> None:
        """End the agents' processes, then every worker (by the PIDs its attempt's files hold), then the control
        plane and the scheduler, then the server."""
        await asyncio.gather(*(asyncio.to_thread(end_process, p) for p in self.agents))
        await asyncio.gather(*(asyncio.to_thread(end_workers, d) for d in self.machine_dirs))
        await asyncio.gather(*(asyncio.to_thread(end_process, p) for p in self.services.values()))
        await shut_down(self.workers, self._running)
        await asyncio.to_thread(self.server.stop)


def read_worker(pid: int) -> Interval | None:
    """A worker's process as its environment names it, open (it lives) since it started (the kernel's clock: seconds
    since boot); None when it is gone or no worker's."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = dict(item.split("=", 1) for item in environ.decode(errors="replace").split("\0") if "=" in item)
    fields = proc_stat(pid)
    try:
        return Interval(
            run=f"{env['ASTRAEUS_NAMESPACE']}/{env['ASTRAEUS_RUN']}",
            task=env["ASTRAEUS_TASK"],
            attempt=int(env["ASTRAEUS_ATTEMPT"]),
            node=env["ASTRAEUS_NODE"],
            gpus=tuple(int(i) for i in env["CUDA_VISIBLE_DEVICES"].split(",") if i),
            pid=pid,
            start=int(fields[19]) / os.sysconf("SC_CLK_TCK") if fields else 0.0,
        )
    except (KeyError, ValueError, IndexError):
        return None


def end_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM by PID, SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_WAIT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def end_workers(machine_dir: Path) -> None:
    """Stop every attempt of a machine whose agent has ended (its process group: SIGTERM, then SIGKILL), then
    reap its shim, which this process adopted (see `become_subreaper`)."""
    runtime = ProcessRuntime(machine_dir / "tasks")
    for key in runtime.attempts():
        shim_file = machine_dir / "tasks" / key.slug / "shim.pid"
        with contextlib.suppress(Exception):  # one that will not stop must not keep the others running
            runtime.stop(key, grace_seconds=0)
        with contextlib.suppress(OSError, ValueError):
            reap(int(shim_file.read_text()))


def reap(pid: int, timeout: float = STOP_WAIT_SECONDS) -> None:
    """Wait for our child `pid` to end (it writes its exit file just before); not ours: nothing to do."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() > deadline:
            if not done:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            return
        time.sleep(0.01)


async def wait_for_poller(client: Client, queue: str, kind: TaskQueueType.ValueType, timeout: float = 60) -> None:
    """Until some worker polls the task queue (a service in its own process has started)."""
    deadline = time.monotonic() + timeout
    request = DescribeTaskQueueRequest(
        namespace=TEMPORAL_NAMESPACE, task_queue=TaskQueue(name=queue), task_queue_type=kind
    )
    while not (await client.workflow_service.describe_task_queue(request)).pollers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker polls {queue} after {timeout:g} s")
        await asyncio.sleep(0.2)
