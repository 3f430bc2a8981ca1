"""The chaos suite's longer faults (issue 39), each named in `--faults` and judged by `bench.chaos_judge` from the
journal the workers write outside Astraeus. They hit the last machine's agent (`m-<M-1>`):

- `partition`: that agent reaches Temporal through a TCP proxy on loopback (`bench.proxy`); the proxy is cut (nothing
  passes, nothing closes) for `--partition-seconds`, then healed.
- `temporal-away`: kill -9 of the Temporal server, started again on the same database file after `--away-seconds`.
- `two-schedulers`: a second `astraeus scheduler` (its own door) and a control plane calling it start beside the
  first ones, as a rolling update starts them; after `--overlap-seconds` the first ones are stopped (SIGTERM).
- `gang-barrier-kill`: once the burst has ended, the agent is frozen (SIGSTOP), a gang spanning every GPU is
  submitted, and when the other machines' members wait at the barrier the frozen agent is killed (kill -9); it is
  started again `--gang-down` seconds after its machine is seen no longer Ready.
- `full-disk`: that machine's data dir is a tmpfs of its own (mounted before the cluster starts, unmounted at the
  end); it is filled for `--full-seconds` while its workers exit, then emptied.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.chaos_checks import Fault, worker_command
from bench.chaos_inject import NAMESPACE, POLL_SECONDS, RESUME_TIMEOUT, Burst, Injector, Options, closed_count
from bench.chaos_judge import GANG_RUN, NEW_FAULTS
from bench.cluster import Cluster
from bench.proxy import TcpProxy
from workers.client import AstraeusClient
from workflows.domain.inventory import NodeState
from workflows.domain.spec import JobSpec, job_id, parse_spec

DISK_BYTES = 16 * 2**20  # the full-disk machine's data dir: room for its attempts' files, not much more
FILL_FILE = ".chaos-fill"
DISK_WORDS = re.compile(r"no space|errno 28|enospc|disk|quota", re.IGNORECASE)


@dataclass
class Setup:
    """What the longer faults need before the cluster starts: the proxy in front of the server for the partitioned
    agent, the small filesystem of the full-disk machine. `close()` undoes both."""

    proxy: TcpProxy | None = None
    mount: Path | None = None

    @classmethod
    async def before(cls, options: Options, cluster: Cluster) -> Setup:
        setup = cls()
        target = cluster.agent_names[-1]
        if "partition" in options.faults:
            setup.proxy = TcpProxy("127.0.0.1", cluster.server.port)
            await setup.proxy.start()
            cluster.agent_temporal[target] = setup.proxy.address
        if "full-disk" in options.faults:
            mount = cluster.machine_dirs[-1]
            mount.mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount)], check=True)
            setup.mount = mount
        return setup

    async def close(self) -> None:
        if self.proxy is not None:
            await self.proxy.close()
        if self.mount is not None:
            (self.mount / FILL_FILE).unlink(missing_ok=True)
            result = subprocess.run(["umount", str(self.mount)], capture_output=True, text=True)
            if result.returncode != 0:  # something still holds it: detach it now, freed once nothing does
                subprocess.run(["umount", "-l", str(self.mount)], check=False)


class LongerFaults(Injector):
    """The injector, with the faults of this module beside the kills of `Injector`."""

    def __init__(
        self, cluster: Cluster, client: AstraeusClient, options: Options, burst: Burst, journal: Path, setup: Setup
    ) -> None:
        super().__init__(cluster, client, options, burst, journal)
        self.setup = setup

    async def one(self, name: str) -> Fault:
        if name not in NEW_FAULTS:
            return await super().one(name)
        process = self.cluster.agent_names[-1]
        node = f"m-{int(process.removeprefix('agents-')):03d}"
        if name == "partition":
            return await self.partition(process, node)
        if name == "temporal-away":
            fault = self.begin(name, "temporal", None)
            await asyncio.to_thread(self.restart_server, True)
            fault.restarted = time.time()
            await self.until_resumed(fault, None)
            return fault
        if name == "two-schedulers":
            return await self.two_schedulers()
        if name == "gang-barrier-kill":
            return await self.gang_barrier_kill(process, node)
        return await self.full_disk(process, node)

    async def partition(self, process: str, node: str) -> Fault:
        proxy = self.setup.proxy
        assert proxy is not None, "the partitioned agent's proxy is set up before the cluster starts"
        fault = self.begin("partition", process, node)
        fault.extra["seconds"] = self.options.partition_seconds
        proxy.cut()
        await asyncio.sleep(self.options.partition_seconds)
        proxy.heal()
        fault.restarted = time.time()
        await self.until_ready(fault)
        return fault

    async def two_schedulers(self) -> Fault:
        fault = self.begin("two-schedulers", "scheduler", None)
        fault.extra["seconds"] = self.options.overlap_seconds
        logs = self.log_sizes()
        control, scheduler = self.cluster.add_services("-2")
        await asyncio.sleep(self.options.overlap_seconds)
        self.cluster.replace("scheduler", scheduler)
        self.cluster.replace("control", control)
        fault.restarted = time.time()
        await self.until_resumed(fault, None)
        fault.extra["refused_in_logs"] = sum(
            len(re.findall("refused", text, re.IGNORECASE)) for text in self.logs_since(logs).values()
        )
        return fault

    async def gang_barrier_kill(self, process: str, node: str) -> Fault:
        deadline = time.monotonic() + self.options.timeout
        while (await closed_count(self.client, NAMESPACE) or 0) < self.options.runs and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)  # the gang takes every GPU: it goes once the burst has ended
        holder = await self.holder(node)
        members = self.options.machines * self.options.gpus
        agent = self.cluster.process(process)
        os.kill(agent.pid, signal.SIGSTOP)  # it takes nothing up: its members never reach the barrier
        frozen = time.monotonic()
        await self.client.submit(self.gang_spec(members))
        at_barrier = await self.until_at_barrier(node, deadline=time.monotonic() + 30)
        fault = self.begin("gang-barrier-kill", process, node)
        fault.extra |= {"members": members, "at_barrier": at_barrier, "frozen_s": round(time.monotonic() - frozen, 1)}
        if at_barrier == 0:
            fault.note = "no member waited at the barrier within 30 s; "
        self.cluster.kill(process)  # SIGKILL ends a stopped process too
        await self.until_down(fault)
        await asyncio.sleep(self.options.gang_down)  # time for the run to act on the loss
        self.cluster.respawn(process)
        fault.restarted = time.time()
        await self.until_resumed(fault, holder)
        await self.until_gang_ends(time.monotonic() + self.options.gang_seconds * 3 + 60)
        with contextlib.suppress(Exception):
            described = await self.client.describe(NAMESPACE, GANG_RUN)
            fault.extra["reason"] = f"{described.status.state}: {described.status.reason}"
            fault.extra["history"] = [f"{e.state}: {e.reason}" for e in described.history]
        return fault

    def gang_spec(self, members: int) -> JobSpec:
        group = {
            "name": "w",
            "replicas": members,
            "command": worker_command(self.options.gang_seconds),
            "env": {"CHAOS_JOURNAL": str(self.journal)},
            "cpu": 0.1,
            "memory_bytes": 0,
            "gpus": 1,
        }
        return parse_spec({"name": GANG_RUN, "namespace": NAMESPACE, "gang": True, "groups": [group]})

    async def until_at_barrier(self, frozen_node: str, deadline: float) -> int:
        """Until every member placed on another machine than the frozen one waits at the barrier: how many do."""
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                tasks = (await self.client.describe(NAMESPACE, GANG_RUN)).tasks
                others = [t for t in tasks if t.node is not None and t.node != frozen_node]
                waiting = [t for t in others if t.status.code == "WaitingAtBarrier"]
                if others and len(waiting) == len(others) and len(others) < len(tasks):
                    return len(waiting)
            await asyncio.sleep(POLL_SECONDS / 2)
        return 0

    async def until_gang_ends(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                execution = await self.client.temporal.get_workflow_handle(job_id(NAMESPACE, GANG_RUN)).describe()
                if execution.close_time is not None:
                    return
            await asyncio.sleep(POLL_SECONDS)

    async def full_disk(self, process: str, node: str) -> Fault:
        mount = self.setup.mount
        assert mount is not None, "the full-disk machine's filesystem is mounted before the cluster starts"
        logs = self.log_sizes()
        fault = self.begin("full-disk", process, node)
        fault.extra["filled_bytes"] = await asyncio.to_thread(fill, mount / FILL_FILE)
        await asyncio.sleep(self.options.full_seconds)
        (mount / FILL_FILE).unlink(missing_ok=True)
        fault.restarted = time.time()
        text = self.logs_since(logs).get(process, "")
        fault.extra["log_lines"] = len(text.splitlines())
        fault.extra["log_disk_lines"] = [line for line in text.splitlines() if DISK_WORDS.search(line)][:5]
        return fault

    async def until_ready(self, fault: Fault) -> None:
        """Until the machine is Ready again (noting whether it was seen not Ready since the fault hit)."""
        deadline = time.monotonic() + RESUME_TIMEOUT
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                view = next((n for n in await self.client.nodes() if n.name == fault.node), None)
                if view is not None and view.state == NodeState.READY:
                    fault.ready_again = time.time()
                    fault.lease_expired = any(
                        e.at.timestamp() > fault.killed and e.state != NodeState.READY for e in view.history
                    )
                    return
            await asyncio.sleep(POLL_SECONDS)
        fault.note += f"machine {fault.node} not Ready again in {RESUME_TIMEOUT:g} s; "

    def log_sizes(self) -> dict[str, int]:
        return {log.stem: log.stat().st_size for log in self.cluster.root.glob("*.log")}

    def logs_since(self, sizes: dict[str, int]) -> dict[str, str]:
        """What each process's log gained since `sizes`."""
        gained = {}
        for log in self.cluster.root.glob("*.log"):
            with log.open("rb") as f:
                f.seek(sizes.get(log.stem, 0))
                gained[log.stem] = f.read().decode(errors="replace")
        return gained


def fill(path: Path) -> int:
    """Write zeros to `path` until its filesystem is full (ENOSPC): the bytes written."""
    written, size = 0, 2**16
    with path.open("wb", buffering=0) as f:
        while size:
            try:
                written += f.write(b"\0" * size) or 0
            except OSError as error:
                if error.errno != errno.ENOSPC:
                    raise
                size //= 2  # then smaller blocks, down to the last byte
    return written
