"""The three long-running processes: control plane, scheduler and node agent, each a Temporal worker."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.worker import Worker

from activities.agent import AgentActivities
from activities.control import ControlActivities
from activities.gpus import GpusUnavailable, GpuWatch, NvmlWatch, read_inventory_gpus
from activities.machine import PROCFS, SYSFS, PressureWatch, data_free_bytes, read_rdma_ports
from activities.prepare import Preparer
from activities.runtime.base import Runtime
from activities.runtime.docker import DockerRuntime
from activities.runtime.process import ProcessRuntime
from activities.scheduler import SchedulerService
from workflows.domain.nodes import NetworkPort, NodeInventory, NodeView, node_id, node_task_queue
from workflows.domain.settings import Settings
from workflows.job import JobWorkflow
from workflows.logs import LogsWorkflow
from workflows.messages import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, NodeInput, RegisterRequest
from workflows.node import NodeWorkflow
from workflows.quotas import QuotasWorkflow

log = logging.getLogger(__name__)


def control_worker(client: Client, settings: Settings) -> Worker:
    """Hosts every JobWorkflow and NodeWorkflow."""
    control = ControlActivities(settings, client)
    return Worker(
        client,
        task_queue=CONTROL_TASK_QUEUE,
        workflows=[JobWorkflow, NodeWorkflow, LogsWorkflow, QuotasWorkflow],
        # machine_lost: for machines that called it here (the scheduler tells runs now)
        activities=[control.load_settings, control.machine_lost, control.cancel_run_workflow],
        max_concurrent_workflow_tasks=200,
    )


async def scheduler_worker(client: Client) -> Worker:
    """Rebuilds the scheduler's view from the durable truth, then serves place / release / node_changed, and
    sweeps away runs that closed without giving their room back."""
    service = SchedulerService(client)
    await service.rebuild()
    service.sweeping = asyncio.ensure_future(service.sweep_forever())
    return Worker(
        client,
        task_queue=SCHEDULER_TASK_QUEUE,
        activities=[
            service.place,
            service.release,
            service.node_changed,
            service.quotas_changed,
            service.plan_workers,
            service.machine_lost,
        ],
        max_concurrent_activities=100,
    )


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
    capabilities: list[str] = field(default_factory=list)  # outbound_policy, sandbox, tool_gateway
    capability_notes: dict[str, str] = field(default_factory=dict)  # why a capability is missing
    data_location: Path | None = None  # where drives held elsewhere are copied; None: none chosen
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
        capabilities=options.capabilities,
        capability_notes=options.capability_notes,
        data_free_bytes=data_free_bytes(options.data_location),
    )


def make_runtime(options: AgentOptions) -> Runtime:
    """`process` or `docker`; raises RuntimeUnavailable when the Docker engine does not answer."""
    if options.runtime == "process":
        return ProcessRuntime(options.data_dir / "tasks")
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


async def register(client: Client, node: NodeInventory, settings: Settings) -> NodeView:
    """Start the machine's NodeWorkflow if it is new, and register this agent with it."""
    handle = await client.start_workflow(
        NodeWorkflow.run,
        NodeInput(name=node.name, settings=settings),
        id=node_id(node.name),
        task_queue=CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    try:
        return await handle.execute_update(NodeWorkflow.register, RegisterRequest(inventory=node))
    except WorkflowUpdateFailedError as error:
        raise RuntimeError(f"machine {node.name} could not register: {error.cause}") from None


async def agent_worker(client: Client, options: AgentOptions, settings: Settings) -> Worker:
    """A node agent: polls the machine's own task queue; registered before it polls."""
    node = inventory(options)
    runtime = make_runtime(options)
    preparer = Preparer(options.data_dir, options.host_paths)
    activities = AgentActivities(client, node, runtime, preparer, gpu_watch(node), pressure_watch(options), settings)
    worker = Worker(
        client,
        task_queue=node_task_queue(node.name),
        activities=[
            activities.hold_lease,
            activities.start_task,
            activities.run_task,
            activities.supervise_task,
            activities.stop_task,
            activities.read_log,
        ],
        max_concurrent_activities=1000,
        graceful_shutdown_timeout=timedelta(seconds=1),
    )
    await register(client, node, settings)
    return worker
