"""The node agent's process: what the machine has (its inventory, read or declared), its runtime, and the agent
that serves the machine's queues, holds its lease, takes it again after it expired, and keeps its fence."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import PollerBehaviorAutoscaling, Worker

from activities.agent import AgentActivities
from activities.agent.capabilities import Services, machine_capabilities
from activities.agent.drives import DriveStore
from activities.agent.gpus import GpusUnavailable, GpuWatch, NvmlWatch, read_inventory_gpus
from activities.agent.identities import Identities
from activities.agent.lease import EXPIRED, TAKEN_OVER, LeaseLost, RegistrationRefused, register
from activities.agent.machine import PROCFS, SYSFS, PressureWatch, data_free_bytes, read_rdma_ports
from activities.agent.mesh import Mesh
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import Runtime
from activities.agent.runtime.cgroups import Unenforced
from activities.agent.runtime.docker import DockerRuntime
from activities.agent.runtime.process import ProcessRuntime
from activities.agent.sessions import Sessions
from activities.instances import new_instance
from workers.services import (
    LEASE_HEARTBEAT_THROTTLE,
    ControlWorker,
    SchedulerWorker,
    lease_serves,
    machine_serves,
    serving,
)
from workflows.contracts import (
    node_id,
)
from workflows.domain.inventory import NetworkPort, NodeInventory, PortRange
from workflows.domain.scheduling.placement import NODE_MESH
from workflows.domain.settings import Settings
from workflows.node import NodeWorkflow

log = logging.getLogger(__name__)

REGISTER_AGAIN_MAX_SECONDS = 10.0  # the longest pause between tries to register again while Temporal does not answer


@dataclass
class AgentOptions:
    name: str
    data_dir: Path
    gpus: str | None = None
    cpus: float | None = None
    memory_bytes: int | None = None
    labels: dict[str, str] = field(default_factory=dict)
    pools: list[str] = field(default_factory=list)
    accept_labels: dict[str, str] = field(default_factory=dict)  # takes only workers that select one of these
    site: str | None = None
    address: str = "127.0.0.1"  # where other machines reach this one (a gang's MASTER_ADDR)
    runtime: str = "process"
    docker_host: str | None = None  # default: $DOCKER_HOST, else the engine's socket
    host_paths: list[str] = field(default_factory=list)  # the only host paths drives may mount; empty: any
    rdma_ports: list[NetworkPort] | None = None  # declared with --rdma-port; None: read from sysfs
    ib_fabric: str | None = None  # names the fabric of its InfiniBand ports (default: their subnet prefix)
    capability_notes: dict[str, str] = field(default_factory=dict)  # why a capability is missing (the operator's)
    services: Services = field(default_factory=Services)  # sandbox runtime, tool gateway, model server
    data_location: Path | None = None  # where drives held elsewhere are copied; None: none chosen
    refuses_runs: str | None = None  # why the machine takes no new runs (--refuse-runs); None: it takes them
    external_ports: PortRange | None = None  # ports it assigns to workers' external access (--external-ports)
    sysfs: Path = SYSFS  # where the host's /sys and /proc are (an agent in a container mounts them elsewhere)
    procfs: Path = PROCFS


def machine_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def declared_ports(options: AgentOptions) -> list[NetworkPort]:
    """--rdma-port, an InfiniBand port without its own fabric taking --ib-fabric's."""
    fabric = options.ib_fabric
    return [
        p.model_copy(update={"fabric": fabric}) if p.link == "InfiniBand" and p.fabric is None else p
        for p in options.rdma_ports or []
    ]


def pressure_watch(options: AgentOptions) -> PressureWatch:
    return PressureWatch(options.data_dir, options.procfs)


def inventory(options: AgentOptions) -> NodeInventory:
    """What this machine has: GPUs from NVML (or declared with --gpus), CPUs and memory (or declared), RDMA ports
    from sysfs (or declared with --rdma-port), its pressure now, its capabilities and its data location's room."""
    gpus, source = read_inventory_gpus(options.gpus, options.name)
    if source == "none":
        log.warning("%s: NVML is not available and no --gpus were declared: running without GPUs", options.name)
    ports = (
        declared_ports(options) if options.rdma_ports is not None else read_rdma_ports(options.sysfs, options.ib_fabric)
    )
    try:
        pressure = pressure_watch(options).poll()
    except OSError as err:
        log.warning("%s: pressure unread (%s): reporting none", options.name, err)
        pressure = []
    return NodeInventory(
        name=options.name,
        cpus=options.cpus if options.cpus is not None else float(os.cpu_count() or 1),
        memory_bytes=options.memory_bytes if options.memory_bytes is not None else machine_memory_bytes(),
        gpus=gpus,
        labels=options.labels,
        gpu_source=source,
        pools=options.pools,
        accept_labels=options.accept_labels,
        site=options.site,
        address=options.address,
        ports=ports,
        pressure=pressure,
        capability_notes=options.capability_notes,
        data_free_bytes=data_free_bytes(options.data_location),
        refuses_runs=options.refuses_runs,
        external_ports=options.external_ports,
    )


def make_runtime(options: AgentOptions) -> Runtime:
    """`process` or `docker`; raises RuntimeUnavailable when the Docker engine does not answer."""
    if options.runtime == "process":
        runtime = ProcessRuntime(options.data_dir / "tasks")
        runtime.prepare()
        if isinstance(runtime.memory, Unenforced):
            log.warning("%s: memory_bytes is not enforced on this machine: %s", options.name, runtime.memory.why)
        return runtime
    if options.runtime == "docker":
        return DockerRuntime(options.name, options.docker_host)
    raise ValueError(f"--runtime {options.runtime}: unknown (built: process, docker)")


def gpu_watch(node: NodeInventory) -> GpuWatch | None:
    """Watch the health of GPUs read from NVML; declared GPUs have none to watch."""
    if node.gpu_source != "nvml":
        return None
    try:
        return NvmlWatch(list(node.gpus))
    except GpusUnavailable as err:
        log.warning("%s: the GPUs' health goes unwatched: %s", node.name, err)
        return None


# Polls a machine's agent keeps on its queue: one waits, and the SDK opens more, up to 8, while the server's answers
# say tasks wait in the queue's backlog (autoscaling). A start handed to a waiting poll (a sync match) must be
# recorded started within 1 s (the server's matching engine); when the server's writes take longer, the write lands
# but the poll never gets the task, and its run waits out the heartbeat timeout (15 s). A start that waits in the
# backlog for the next poll has 10 s. With 8 polls always waiting, 6 bursts of 500 on a slow day lost 25 starts, with
# 4 they lost 5; in bursts of 1,000, where the server recorded 40 to 50% of its tasks after more than 1 s, 4 polls lost
# 3, 23 and 61 starts in three bursts of one hour, one poll and more on demand 0, 0, 0, 8 and 1 in five of the same
# hours. A machine's starts are picked up a few tenths of a second later in a burst of 500 (bench/README.md). A server
# older than Temporal 1.28 sends no such answers: there the agent keeps to its one poll, and takes a machine's starts
# one poll round trip at a time.
MACHINE_POLLERS = PollerBehaviorAutoscaling(minimum=1, maximum=8, initial=1)


class Agent:
    """A node agent: one Temporal worker on the machine's task queue (its workers' activities) and one on its own
    lease queue. It runs until shut down. When its lease expires (it was paused, or cut off from Temporal) it
    registers again on its own, keeping its workers (those their runs lost it stops as it looks for stale attempts);
    only when another agent holds the machine does it stop its workers and raise LeaseLost, rather than run beside
    the agent that holds the machine now."""

    def __init__(
        self, client: Client, activities: AgentActivities, grace_seconds: float, settings: Settings | None = None
    ) -> None:
        self.name = activities.node_name
        self.activities = activities
        self._client = client
        self._grace = grace_seconds
        self._settings = settings or Settings()
        # A worker's heartbeats reach the server every half of the stale grace (7.5 s of 15). The SDK's default
        # (0.8 x the timeout: 12 s of 15) left 3 s for a heartbeat to arrive: on a busy server, workers that ran
        # went Stale (bench/README.md, 1,000 runs). Each is a write of the run's workflow: every third of the
        # grace cost a 1,000-run burst 2 to 3 heartbeats per run, the largest count of any request; every half,
        # a third fewer, and 7.5 s for one to arrive. A worker's first heartbeat leaves less
        # (activities/agent.py: FIRST_BEAT_INTERVALS).
        beats = timedelta(seconds=self._settings.stale_grace_seconds / 2)
        self.machine = serving(
            client,
            machine_serves(activities),
            max_concurrent_activities=1000,
            graceful_shutdown_timeout=timedelta(seconds=1),
            activity_task_poller_behavior=MACHINE_POLLERS,
            max_heartbeat_throttle_interval=beats,
            default_heartbeat_throttle_interval=beats,
        )
        self.lease = serving(
            client,
            lease_serves(activities),
            graceful_shutdown_timeout=timedelta(seconds=1),
            # Every renewal reaches the server when it is made. The SDK's default sends a heartbeat at most every
            # 0.8 x its timeout (the lease), so a lease renewed last 24 s before a crash expired 6 s after it.
            max_heartbeat_throttle_interval=LEASE_HEARTBEAT_THROTTLE,
            default_heartbeat_throttle_interval=LEASE_HEARTBEAT_THROTTLE,
        )

    async def run(self) -> None:
        runs = [asyncio.ensure_future(self.machine.run()), asyncio.ensure_future(self.lease.run())]
        watching = asyncio.ensure_future(self._watch_lease())
        fencing = asyncio.ensure_future(self.activities.keep_fence())
        stopped = 0
        try:
            while True:
                lost = asyncio.ensure_future(self.activities.lost.wait())
                await asyncio.wait([*runs, lost], return_when=asyncio.FIRST_COMPLETED)
                lost.cancel()
                if not self.activities.lost.is_set() or not await self._register_again(runs):
                    break
        finally:
            watching.cancel()
            fencing.cancel()
            if self.activities.lost.is_set():
                stopped = await self.activities.stop_own_tasks(self._grace)
            await self.shutdown()
            await asyncio.to_thread(self.activities.node_network.close)  # it leaves the mesh
            results = await asyncio.gather(*runs, return_exceptions=True)
        if self.activities.lost.is_set():
            holder = await self._holder()
            now = f"; the machine is now held by agent {holder}" if holder else ""
            raise LeaseLost(
                f"agent {self.activities.instance} of machine {self.name}: {self.activities.lost_why}{now}. "
                f"It stopped its {stopped} running worker(s) and exits rather than run beside another agent"
            )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _register_again(self, runs: Sequence[asyncio.Future[None]]) -> bool:
        """After the lease expired, take it again (the same instance), keeping the workers: True once registered.
        False when the lease was taken over, or another live agent holds the machine now (then this one ends), or
        when this agent's Temporal workers ended meanwhile. Temporal not answering is waited out."""
        if self.activities.lost_why != EXPIRED:
            return False
        pause = 0.5
        while not any(run.done() for run in runs):
            try:
                inventory, instance = self.activities.inventory(), self.activities.instance
                await self.activities.remove_deleted_runs()  # runs deleted while it was away: before it takes work
                view = await register(self._client, inventory, self._settings, instance)
            except RegistrationRefused as refused:
                log.warning("%s: could not take its lease again: %s", self.name, refused)
                return False
            except Exception as err:  # Temporal does not answer (an outage): try again
                log.warning("%s: could not register again (%s): trying again in %g s", self.name, err, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, REGISTER_AGAIN_MAX_SECONDS)
                continue
            self.activities.registered(view)
            log.warning("%s: its lease had expired: registered again, keeping its workers", self.name)
            return True
        return False

    async def _watch_lease(self) -> None:
        """A safety net: should no lease reach this agent for twice its TTL (its cancellation never arrived), ask the
        machine's workflow who holds the machine, and count the lease lost if this agent does not."""
        ttl = self._settings.node_lease_ttl_seconds
        while True:
            await asyncio.sleep(max(ttl / 2, 0.1))
            if self.activities.lost.is_set() or self.activities.lease_idle_seconds() < 2 * ttl:
                continue
            try:
                handle = self._client.get_workflow_handle(node_id(self.name))
                view = await asyncio.wait_for(handle.query(NodeWorkflow.view), 10)
            except Exception as err:  # asked again next time
                log.warning("%s: could not read who holds the machine: %s", self.name, err)
                continue
            if view.holder != self.activities.instance and not self.activities.lost.is_set():
                self.activities.lost_why = EXPIRED if view.holder is None else TAKEN_OVER
                self.activities.lost.set()

    async def shutdown(self) -> None:
        for worker in (self.machine, self.lease):
            with contextlib.suppress(Exception):
                await worker.shutdown()

    async def _holder(self) -> str | None:
        try:
            handle = self._client.get_workflow_handle(node_id(self.name))
            view = await asyncio.wait_for(handle.query(NodeWorkflow.view), 10)
        except Exception as err:  # a message without the new holder is still the right message
            log.warning("%s: could not read who holds the machine now: %s", self.name, err)
            return None
        return view.holder if view.holder != self.activities.instance else None


# What the embedded default and the benchmarks run side by side in one process: each has run() and shutdown().
Part = Worker | ControlWorker | SchedulerWorker | Agent


def mesh_of(client: Client, options: AgentOptions, settings: Settings) -> Mesh:
    """The machine's end of the mesh (`--mesh-endpoint`), its key and wireguard-go's PID kept under its data dir."""
    endpoint = options.services.mesh_endpoint
    assert endpoint is not None
    state = options.data_dir / "mesh"
    return Mesh(client, options.name, endpoint, options.services.mesh_netns, state, settings.mesh_refresh_seconds)


async def start_agent(client: Client, options: AgentOptions, settings: Settings) -> Agent:
    """A node agent, registered (its machine's lease taken) before it polls; raises RegistrationRefused while
    another live agent holds the machine."""
    store = DriveStore(options.name, options.data_location)
    node = inventory(options).model_copy(update=dict(store.report()))
    runtime = make_runtime(options)
    capabilities, notes = machine_capabilities(runtime, options.services, options.capability_notes)
    node = node.model_copy(update={"capabilities": capabilities, "capability_notes": notes})
    mesh = mesh_of(client, options, settings) if NODE_MESH in capabilities else None
    preparer = Preparer(options.data_dir, options.host_paths, store, mounts=options.runtime == "docker")
    instance = new_instance()
    identities = Identities(client, options.data_dir, node.name)
    activities = AgentActivities(
        client,
        node,
        runtime,
        preparer,
        gpu_watch(node),
        pressure_watch(options),
        settings,
        instance=instance,
        identities=identities,
        services=options.services,
        sessions=Sessions(runtime, options.data_dir, node.name, options.services.interactive_sessions),
        mesh=mesh,
    )
    agent = Agent(client, activities, settings.stop_grace_seconds, settings)
    await activities.adopt_attempts()
    activities.registered(await register(client, node, settings, instance))
    return agent
