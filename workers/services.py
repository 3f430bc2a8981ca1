"""The three long-running processes: control plane, scheduler and node agent, each a Temporal worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.worker import PollerBehaviorAutoscaling, PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker
from temporalio.worker._worker import load_default_build_id  # the SDK's default build, not exported

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
from activities.control import DEFAULT_CA_DIR, ControlActivities
from activities.instances import new_instance
from activities.scheduler import SchedulerService
from activities.scheduler_lease import LeaseHeld, SchedulerLeaseHolder
from activities.scheduler_link import DEFAULT_ADDRESS, SchedulerDoor, SchedulerLink
from workflows.contracts import (
    CONTROL_TASK_QUEUE,
    SCHEDULER_TASK_QUEUE,
    lease_task_queue,
    node_id,
    node_task_queue,
    scheduler_lease_task_queue,
)
from workflows.deleted_runs import DeletedRunsWorkflow
from workflows.deletion import DeleteRunWorkflow
from workflows.domain.inventory import NetworkPort, NodeInventory, PortRange
from workflows.domain.scheduling.placement import NODE_MESH
from workflows.domain.settings import Settings
from workflows.drives import DrivesWorkflow
from workflows.identity import IdentityWorkflow
from workflows.job import JobWorkflow
from workflows.logs import LogsWorkflow
from workflows.node import NodeWorkflow
from workflows.quotas import QuotasWorkflow
from workflows.scheduler_lease import SchedulerLeaseWorkflow
from workflows.sessions import SessionWorkflow
from workflows.subnets import SubnetsWorkflow
from workflows.tokens import TokensWorkflow

log = logging.getLogger(__name__)

REGISTER_AGAIN_MAX_SECONDS = 10.0  # the longest pause between tries to register again while Temporal does not answer


# The control plane runs the workflows outside the SDK's sandbox. Inside it, with the workflows' modules passed
# through it (importing them again for every run cost 13 ms of CPU per run), each activation still entered and left
# the sandbox, and so did each payload the SDK converted on the way in and out: a quarter of this process's CPU in a
# burst of 500 (py-spy), 14 ms per run against 10 without it, and the burst's workflow tasks waited behind it
# (bench/README.md). What the sandbox refused at run time is refused before: tests/test_workflow_code.py reads every
# workflow module for a clock, randomness or I/O, the workflow tests run the same workflows in the full sandbox (the
# SDK's default runner, tests/workflows/fakes.py), and the replay tests replay committed histories in it.
WORKFLOW_RUNNER = UnsandboxedWorkflowRunner()

# How the control plane's worker takes workflow tasks. A run's first task comes from the shared queue, its others
# from this worker's sticky queue. The SDK's default (5 pollers, one in six on the shared queue) took a burst's
# first tasks one poll round trip at a time: 200 runs waited a median of 17 s for their first task. 50 pollers took
# them sooner, but then some tasks the server handed to them never reached this worker and timed out (10 s each, for
# 2 to 8% of a burst's runs). 10 pollers shared evenly left 5 on the sticky queue: in a burst of 500 the runs' next
# tasks (the agent's report) waited a median of 9 s there and 200 to 430 of them passed the sticky queue's 10 s,
# went back to the shared queue and were replayed whole. 20 pollers, at most a quarter of them (5) on the shared
# queue, keep that wait under a second, with no timeout, and take first tasks as fast (bench/README.md). A run
# cached stays cached: 4,000 runs and machines fit. A run's first task runs its local activities (load_settings,
# place) while it holds its slot: as many of those as tasks.
WORKFLOW_TASK_OPTIONS: dict[str, Any] = {
    "max_concurrent_workflow_tasks": 200,
    "max_concurrent_local_activities": 200,
    "workflow_task_poller_behavior": PollerBehaviorSimpleMaximum(maximum=20),
    "nonsticky_to_sticky_poll_ratio": 0.25,
    "max_cached_workflows": 4000,
}


@dataclass(frozen=True)
class Serves:
    """What one Temporal worker of a process registers: its task queue, its workflows and its activities
    (tests/test_contracts.py checks them against every call the workflows make)."""

    task_queue: str
    workflows: list[type] = field(default_factory=list)
    activities: list[Callable[..., Any]] = field(default_factory=list)


def control_serves(control: ControlActivities, link: SchedulerLink) -> Serves:
    """The control plane: every workflow, their local activities, and the activity `machine_lost` for machines that
    called it here (the scheduler tells runs now)."""
    return Serves(
        CONTROL_TASK_QUEUE,
        [
            JobWorkflow,
            NodeWorkflow,
            LogsWorkflow,
            QuotasWorkflow,
            TokensWorkflow,
            DeleteRunWorkflow,
            DeletedRunsWorkflow,
            DrivesWorkflow,
            IdentityWorkflow,
            SessionWorkflow,
            SubnetsWorkflow,
            SchedulerLeaseWorkflow,
        ],
        [
            control.load_settings,
            control.issue_identity,
            control.tell_runs_machine_lost,
            control.cancel_run_workflow,
            link.place,
            link.release,
            control.end_run,
            control.forget_run,
        ],
    )


def scheduler_serves(service: SchedulerService) -> Serves:
    """The scheduler service; place and release for runs of protocols before 3."""
    return Serves(
        SCHEDULER_TASK_QUEUE,
        activities=[
            service.place,
            service.release,
            service.node_changed,
            service.quotas_changed,
            service.drives_changed,
            service.drive_users,
            service.plan_group,
            service.tell_runs_machine_lost,
        ],
    )


def machine_serves(activities: AgentActivities) -> Serves:
    """A node agent's machine queue: its workers' activities."""
    return Serves(
        node_task_queue(activities.node_name),
        activities=[
            activities.start_task,
            activities.run_task,
            activities.supervise_task,
            activities.stop_task,
            activities.read_log,
            activities.grant_session,
            activities.attach_session,
            activities.delete_run_files,
            activities.drives.use_data_location,
        ],
    )


def scheduler_lease_serves(lease: SchedulerLeaseHolder) -> Serves:
    """A scheduler process's own lease queue."""
    return Serves(scheduler_lease_task_queue(lease.instance), activities=[lease.hold])


def lease_serves(activities: AgentActivities) -> Serves:
    """A node agent's own lease queue."""
    return Serves(lease_task_queue(activities.node_name, activities.instance), activities=[activities.hold_lease])


def serving(client: Client, serves: Serves, **options: Any) -> Worker:
    """The Temporal worker that registers what `serves` says."""
    return Worker(
        client, task_queue=serves.task_queue, workflows=serves.workflows, activities=serves.activities, **options
    )


class ControlWorker:
    """The control plane's Temporal worker, hosting every JobWorkflow and NodeWorkflow, and its link to the
    scheduler's door at `scheduler` (HOST:PORT: the runs' `place` and `release`, as local activities; or the door
    itself, when the scheduler runs in this process), closed when the worker ends."""

    def __init__(
        self,
        client: Client,
        settings: Settings,
        scheduler: str | SchedulerDoor = DEFAULT_ADDRESS,
        ca_dir: Path = DEFAULT_CA_DIR,
    ) -> None:
        self.link = SchedulerLink(scheduler)
        control = ControlActivities(settings, client, ca_dir, scheduler=self.link)
        self.worker = serving(
            client, control_serves(control, self.link), workflow_runner=WORKFLOW_RUNNER, **WORKFLOW_TASK_OPTIONS
        )
        # The build the worker names in each task it completes: the SDK's default, a hash of the code this process
        # loaded, computed once per process (a client beside it lists it on the runs it starts: workers/client.py).
        self.build_id = load_default_build_id()

    async def run(self) -> None:
        try:
            await self.worker.run()
        finally:
            await self.link.close()

    async def shutdown(self) -> None:
        await self.worker.shutdown()


class SchedulerWorker:
    """A scheduler process: its lease's worker (on its own queue), its door, and, for each term it holds the lease,
    a view rebuilt from the durable truth with its Temporal worker (node_changed, quotas_changed, ...; place and
    release for runs of protocols before 3) and its sweep. A second scheduler waits as a standby: it polls no
    scheduler queue, its door refuses every call saying who holds the lease, and it claims the lease again every
    sixth of its TTL, taking over once the holder's lease expired. A scheduler that loses its lease (paused or cut off
    past its TTL, or taken over) places nothing from that moment: its door refuses, its worker stops, what it decided
    but did not send is dropped; when it holds the lease again it rebuilds its view and places again."""

    def __init__(
        self,
        client: Client,
        door: SchedulerDoor,
        lease: SchedulerLeaseHolder,
        new_service: Callable[[int], Awaitable[SchedulerService]] | None = None,
    ) -> None:
        self._client = client
        self.door = door
        self.lease = lease
        self._new_service = new_service or self._rebuilt
        self.service: SchedulerService | None = None  # the term's, while it holds the lease
        self.worker: Worker | None = None  # the term's worker on SCHEDULER_TASK_QUEUE
        self._lease_worker = serving(
            client,
            scheduler_lease_serves(lease),
            graceful_shutdown_timeout=timedelta(seconds=1),
            max_heartbeat_throttle_interval=LEASE_HEARTBEAT_THROTTLE,  # every renewal reaches the server when made
            default_heartbeat_throttle_interval=LEASE_HEARTBEAT_THROTTLE,
        )
        self._lease_running: asyncio.Future[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Poll the lease's queue and claim the lease; once granted, rebuild the view (before returning: the embedded
        default starts its machines after it). A fresh cluster's first claim is granted at once."""
        if self._lease_running is None:
            self._lease_running = asyncio.ensure_future(self._lease_worker.run())
        await self._begin_term()

    async def _rebuilt(self, epoch: int) -> SchedulerService:
        service = SchedulerService(self._client, epoch=epoch)
        await service.rebuild()
        return service

    async def _begin_term(self) -> bool:
        """Claim the lease and, once granted, rebuild a view for the term: True when it holds both. False while
        another scheduler holds the lease (its door says so) or Temporal does not answer."""
        try:
            granted = await self.lease.claim()
        except LeaseHeld as held:
            if self.door.refusal != str(held):
                log.warning("the scheduler waits as a standby: %s", held)
            self.door.refuse(str(held))
            return False
        except Exception as error:  # Temporal does not answer, or no control plane runs the lease's workflow yet
            log.warning("the scheduler could not claim its lease (tried again): %s", error)
            self.door.refuse(f"the scheduler could not claim its lease: {error}")
            return False
        epoch = granted.epoch
        log.warning("the scheduler %s holds the lease, epoch %d: rebuilding its view", self.lease.instance, epoch)
        self.door.refuse(f"the scheduler holds the lease (epoch {epoch}) and rebuilds its view")
        try:
            service = await self._new_service(epoch)
        except Exception:
            log.exception("the scheduler could not rebuild its view (epoch %d); it gives its term up", epoch)
            self.lease.lose("its view could not be rebuilt")
            return False
        if not self.lease.holds(epoch):
            service.stop(self.lease.why)
            return False
        self.service = service
        self.worker = serving(self._client, scheduler_serves(service), max_concurrent_activities=100)
        return True

    async def run(self) -> None:
        if self._lease_running is None:
            self._lease_running = asyncio.ensure_future(self._lease_worker.run())
        try:
            await self.door.listen()
            while not self._stopping.is_set():
                if self.service is None and not await self._begin_term():
                    await self._pause(self.lease.ttl / 6)
                    continue
                await self._serve_term()
        finally:
            await self._close()

    async def _close(self) -> None:
        """Stop polling the lease's queue, and close the door."""
        if self._lease_running is not None:
            with contextlib.suppress(Exception):
                await self._lease_worker.shutdown()
            with contextlib.suppress(BaseException):
                await self._lease_running
        await self.door.close()

    async def _serve_term(self) -> None:
        """Serve until the lease is lost or the process shuts down; then place nothing more."""
        service, worker = self.service, self.worker
        assert service is not None and worker is not None
        epoch = service.epoch
        service.sweeping = asyncio.ensure_future(service.sweep_forever())
        running = asyncio.ensure_future(worker.run())
        self.door.serve(service)
        try:
            while self.lease.holds(epoch) and not self._stopping.is_set() and not running.done():
                await self._pause(self.lease.ttl / 6, running)
        finally:
            why = self.lease.why or "the scheduler is shutting down"
            if not self.lease.holds(epoch) and not self.lease.lost.is_set():
                self.lease.lose(f"no renewal reached it for {self.lease.ttl:g} s")
                why = self.lease.why
            self.door.refuse(why)  # first: nothing is placed from here on
            service.stop(why)
            with contextlib.suppress(asyncio.CancelledError):
                await service.sweeping
            with contextlib.suppress(Exception):
                await worker.shutdown()
            self.service = self.worker = None
            await asyncio.gather(running, return_exceptions=True)
        if not self._stopping.is_set() and running.done() and not running.cancelled():
            running.result()  # the worker failed: the process ends, saying why

    async def _pause(self, seconds: float, *also: asyncio.Future[None]) -> None:
        """Wait `seconds`, or less when the lease is lost, the process shuts down, or one of `also` ends."""
        waits: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self.lease.lost.wait()),
            asyncio.ensure_future(self._stopping.wait()),
        ]
        try:
            await asyncio.wait([*waits, *also], timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def shutdown(self) -> None:
        self._stopping.set()
        if self.worker is not None:
            with contextlib.suppress(Exception):
                await self.worker.shutdown()


async def scheduler_worker(
    client: Client, door: SchedulerDoor | None = None, settings: Settings | None = None
) -> SchedulerWorker:
    """A scheduler process: it claims the scheduler's lease and, when granted, rebuilds its view from the durable
    truth before returning; then (run) it serves place / release at its door (default DEFAULT_ADDRESS, bound before
    the rebuild), node_changed and the others on its queue, and sweeps away runs that closed without giving their
    room back, for as long as it holds the lease. Refused the lease, it waits as a standby."""
    door = door or SchedulerDoor()
    scheduler = SchedulerWorker(client, door, SchedulerLeaseHolder(client, settings or Settings()))
    try:
        await scheduler.start()
    except BaseException:
        await scheduler._close()
        raise
    return scheduler


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


LEASE_HEARTBEAT_THROTTLE = timedelta(seconds=1)

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
