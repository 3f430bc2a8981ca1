"""Feasibility: whether one machine takes one waiting worker now, and when not, the spec's per-machine reasons.

Each check is `(machine, free, ask) -> Reason | None`, run in the fixed order of CHECKS (the order of the spec's
per-machine table, cheap first), as Nomad's feasibility checkers are. `fits` stops at the first reason; `explain`
lists them all. The queue, reservation, backfill, preemption and quotas are in `workflows/domain/scheduling/queue.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from workflows.domain.constraints import POOL_LABEL, Drive
from workflows.domain.inventory import NetworkPort
from workflows.domain.reasons import R, Reason, Template, number
from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.scheduling.machines import EPSILON, Cluster, CompiledNode, Free, free_capacity, size_text

__all__ = ["CHECKS", "Allocation", "Ask", "Free", "TaskRequest", "ask_for", "explain", "fill", "fits", "free_capacity"]


@dataclass
class Ask:
    """One request as the checks see it: the request, where its run's workers are, and the cluster's drives."""

    request: TaskRequest
    run_nodes: Counter[str] = field(default_factory=Counter)
    run_racks: Counter[str] = field(default_factory=Counter)
    group_nodes: Counter[str] = field(default_factory=Counter)  # where its group's workers are (`spread`)
    drives: Mapping[str, Drive] = field(default_factory=dict)
    run_fabrics: frozenset[str] = frozenset()  # the InfiniBand fabrics its run's machines are on


def ask_for(request: TaskRequest, cluster: Cluster, drives: Mapping[str, Drive]) -> Ask:
    if not request.with_run:
        return Ask(request, drives=drives)
    nodes = cluster.run_nodes.get(request.job_id, {})
    group = Counter(cluster.group_nodes.get((request.job_id, request.group), ())) if request.spread else Counter()
    return Ask(
        request, Counter(nodes), cluster.racks_of(request.job_id), group, drives, cluster.fabrics_of(request.job_id)
    )


def ask_key(ask: Ask) -> tuple[object, ...]:
    """What of an ask the checks read (drives are the same for a whole pass): a key for answers remembered."""
    request = ask.request
    return (request.shape, *where(ask)) if request.with_run else (request.shape,)


def where(ask: Ask) -> tuple[object, ...]:
    """Where the ask's run and group are, as cache keys see it."""
    return tuple(sorted(ask.run_nodes.items())), tuple(sorted(ask.group_nodes.items()))


Check = Callable[[CompiledNode, Free, Ask], Reason | None]


@lru_cache(maxsize=1 << 16)
def _filled(template: Template, values: tuple[tuple[str, object], ...]) -> Reason:
    return template.fill(**dict(values))


def fill(template: Template, **values: object) -> Reason:
    """`template.fill(...)`, remembered: thousands of machines say the same few sentences."""
    return _filled(template, tuple(values.items()))


# ---- the machine's own state -----------------------------------------------------------------------------------


def check_ready(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """A machine that is Down, or has not reported what it has, takes nothing (and has nothing else to say)."""
    return node.not_ready


def check_pressure(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    return node.pressure


def check_open(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """Cordoned by an admin, or its agent takes no new runs."""
    return node.closed


# ---- which machines the worker may use --------------------------------------------------------------------------


def check_accepted_labels(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """A machine with accepted labels takes only workers whose selection names one of them."""
    if not node.accepts:
        return None
    selection = ask.request.selection
    wanted = selection.labels if selection else {}
    if any(wanted.get(key) == value for key, value in node.accepts):
        return None
    return fill(R.NoAcceptedLabel)


def check_names(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    selection = ask.request.selection
    if selection and selection.names and node.name not in selection.names:
        return fill(R.NotSelectedName)
    return None


def check_labels(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """Labels, then pools (shown as the label pool.astraeus.io/name): the first one missing."""
    selection = ask.request.selection
    if selection is None:
        return None
    for key, value in sorted(selection.labels.items()):
        if node.labels.get(key) != value:
            return fill(R.LacksLabel, key=key, value=value)
    for pool in selection.pools:
        if pool not in node.pools:
            return fill(R.LacksLabel, key=POOL_LABEL, value=pool)
    return None


# What a machine that can host the node network (network.mesh) reports among its capabilities; and one in the mesh
# between machines, which a run on the node network needs unless it is kept on one machine.
NODE_NETWORK = "node_network"
NODE_MESH = "mesh"


def check_network(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """The node network: a machine that hosts it, and, for a run not kept on one machine, one in the mesh between
    machines (its workers may be on several). RDMA: any active port. InfiniBand: an active port at the speed
    asked, on the fabric asked; a gang's members after the first placed ones also on one of their fabrics (members
    on two fabrics cannot reach each other)."""
    network = ask.request.network
    if network is None:
        return None
    if network.mesh and NODE_NETWORK not in node.capabilities:
        return fill(R.NoNodeNetwork, why=node.capability_notes.get(NODE_NETWORK, "not reported by its agent"))
    one_machine = ask.request.topology is not None and ask.request.topology.one_machine
    if network.mesh and not one_machine and NODE_MESH not in node.capabilities:
        return fill(R.NoNodeNetwork, why=node.capability_notes.get(NODE_MESH, "not in the mesh, by its agent's report"))
    if network.infiniband:
        fabrics = {network.fabric} if network.fabric else set()
        if ask.request.gang and ask.run_fabrics:
            fabrics = fabrics & ask.run_fabrics if fabrics else set(ask.run_fabrics)
        speed = network.infiniband_gbps or 0
        infiniband = [p for p in node.ports if p.link == "InfiniBand"]
        if any(p.active and p.speed_gbps >= speed and (not fabrics or p.fabric in fabrics) for p in infiniband):
            return None
        return _no_infiniband(infiniband, network.infiniband_gbps, network.fabric, ask)
    if network.rdma and not any(p.active for p in node.ports):
        return fill(R.NoRdmaPort)
    return None


def _no_infiniband(ports: list[NetworkPort], speed: int | None, fabric: str | None, ask: Ask) -> Reason:
    """The spec's reason for a speed, ours for a fabric alone; the detail lists the machine's InfiniBand ports
    (with their fabric when one was asked, or the gang is on one)."""
    on_fabric = fabric is not None or (ask.request.gang and bool(ask.run_fabrics))

    def port(p: NetworkPort) -> str:
        text = f"{p.name} {'active' if p.active else 'down'} at {p.speed_gbps} Gb/s"
        return f"{text} on fabric {p.fabric or 'unknown'}" if on_fabric else text

    detail = ", ".join(port(p) for p in ports) or "no InfiniBand port"
    if ask.request.gang and ask.run_fabrics:
        detail += f"; its gang is on fabric {', '.join(sorted(ask.run_fabrics))}"
    if speed is not None:
        return fill(R.NoInfinibandPort, speed=speed, detail=detail)
    return fill(R.NoFabricPort, fabric=fabric, detail=detail)


def check_one_per_machine(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """topology.one_per_machine: one worker of the run per machine; a group of total_gpus (`spread`): one worker
    of the group per machine, as it was planned."""
    topology = ask.request.topology
    if topology is not None and topology.one_per_machine and ask.run_nodes.get(node.name):
        return fill(R.AnotherWorkerOnMachine)
    if ask.request.spread and ask.group_nodes.get(node.name):
        return fill(R.AnotherWorkerOnMachine)
    return None


# ---- room -------------------------------------------------------------------------------------------------------


def check_cpu(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    if ask.request.cpu > free.cpu + EPSILON:
        return fill(R.InsufficientCpu, need=number(ask.request.cpu), free=number(max(free.cpu, 0)))
    return None


def check_memory(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    if ask.request.memory_bytes > free.memory_bytes:
        return fill(R.InsufficientMemory, need=ask.request.memory_bytes, free=max(free.memory_bytes, 0))
    return None


def check_gpu_model(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """gpu_requests: no GPU of the machine is one the worker accepts."""
    request = ask.request
    if not (request.gpus and request.gpu_requests) or len(node.faults) == len(node.gpus):
        return None  # nothing asked, or no working GPU to tell apart (a GPU fault or "insufficient gpus" says it)
    if node.matching(request.gpu_requests)[0] == 0:
        return fill(R.NoMatchingGpu, request=" or ".join(w.describe() for w in request.gpu_requests))
    return None


def check_gpu_fault(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """A GPU with a fatal fault (Xid 79: fallen off the bus, ...) keeps every GPU worker off the machine."""
    if ask.request.gpus and node.faults:
        gpu = node.faults[0]
        return fill(R.GpuFault, index=gpu.index, fault=gpu.fault)
    return None


def usable_gpus(node: CompiledNode, free: Free, request: TaskRequest) -> tuple[int, int]:
    """(free GPUs the worker may use, of which at risk). Counted conservatively: GPUs that are held are taken to
    be the usable ones, and GPUs at risk to be free."""
    matching, at_risk = node.matching(request.gpu_requests)
    usable = max(0, min(free.gpus, matching - (len(node.gpus) - free.gpus)))
    return usable, min(at_risk, usable)


def check_gpus(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    request = ask.request
    if not request.gpus or node.faults or check_gpu_model(node, free, ask):
        return None  # no GPU asked, or the fault or model reason already says why
    usable, at_risk = usable_gpus(node, free, request)
    if request.gpus > usable:
        return fill(R.InsufficientGpus, need=request.gpus, free=usable)
    if request.healthy_only and request.gpus > usable - at_risk:
        return fill(R.HealthyGpus, need=request.gpus, free=usable - at_risk, at_risk=at_risk)
    return None


# ---- the run's shape --------------------------------------------------------------------------------------------


def check_topology(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    topology = ask.request.topology
    if topology is None:
        return None
    if topology.one_machine and ask.run_nodes and node.name not in ask.run_nodes:
        return fill(R.KeptOnOneMachine, node=min(ask.run_nodes))
    rack = node.rack
    if (topology.same_rack or topology.one_per_rack) and rack is None:
        return fill(R.NoRackLabel)
    if topology.same_rack and ask.run_racks and rack not in ask.run_racks:
        return fill(R.KeptWithinRack, rack=min(ask.run_racks))
    limit = topology.max_machines
    if limit is not None and node.name not in ask.run_nodes and len(ask.run_nodes) >= limit:
        return fill(R.MaxMachines, n=limit)
    if topology.one_per_rack and rack is not None and ask.run_racks.get(rack):
        return fill(R.RackAlreadyUsed, rack=rack)
    return None


def check_drives(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """Each drive exists and is usable; one held on another machine is copied to this one's data location, which
    must exist (else "Choose where to keep data on <machine>") and have room for every copy not made yet."""
    room = node.data_free
    for name in ask.request.drives:
        drive = ask.drives.get(name)
        if drive is None:
            return fill(R.DriveMissing, drive=name)
        if drive.problem:
            return fill(R.DriveProblem, drive=name, why=drive.problem)
        if drive.node == node.name:
            continue
        if name in node.copies and (drive.site is None or drive.site == node.site):
            continue  # filled here before: reused, it needs no more room
        if drive.node is not None and drive.site and drive.site != node.site:
            return fill(R.DriveOtherSite, drive=name, node=drive.node, site=drive.site)
        if room is None:
            return fill(R.ChooseDataLocation, node=node.name)
        if drive.size_bytes > room:
            return fill(R.DriveNoSpace, drive=name, size=size_text(drive.size_bytes), free=size_text(room))
        room -= drive.size_bytes
    return None


def check_capabilities(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    for capability in ask.request.capabilities:
        if capability not in node.capabilities:
            why = node.capability_notes.get(capability, "not reported by its agent")
            return _CAPABILITY_REASONS[capability](why=why)
    return None


def check_external_ports(node: CompiledNode, free: Free, ask: Ask) -> Reason | None:
    """A worker with external access needs a machine whose agent assigns that many ports. Whether they are free
    now is the machine's to say: the worker waits there "Waiting for its external port to be assigned"."""
    wanted = ask.request.external_ports
    if not wanted or node.external_ports >= wanted:
        return None
    if not node.external_ports:
        return fill(R.NoExternalPorts, why="its agent has no --external-ports range")
    return fill(R.NoExternalPorts, why=f"its range holds {node.external_ports}, the worker needs {wanted}")


_CAPABILITY_REASONS = {"outbound_policy": R.NoOutboundPolicy, "sandbox": R.NoSandbox, "tool_gateway": R.NoToolGateway}

# The fixed order: the spec's per-machine table, cheap first. The machine's own state, then what the worker may
# use, then room (GPU model and faults before the count, which depends on them), then the run's shape.
CHECKS: tuple[Check, ...] = (
    check_ready,
    check_pressure,
    check_open,
    check_accepted_labels,
    check_names,
    check_labels,
    check_network,
    check_one_per_machine,
    check_cpu,
    check_memory,
    check_gpu_model,
    check_gpu_fault,
    check_gpus,
    check_topology,
    check_drives,
    check_capabilities,
    check_external_ports,
)


def fits(node: CompiledNode, free: Free, ask: Ask) -> bool:
    return all(check(node, free, ask) is None for check in CHECKS)


def explain(node: CompiledNode, free: Free, ask: Ask) -> list[Reason]:
    """Every reason the machine does not take the worker now; empty when it does. A machine that is not ready
    says only that."""
    if node.not_ready is not None:
        return [node.not_ready]
    return [reason for check in CHECKS if (reason := check(node, free, ask))]


def fit_together_empty(
    cluster: Cluster, requests: Sequence[TaskRequest], names: list[str], drives: Mapping[str, Drive]
) -> bool:
    """Whether the workers of one run would all fit at once if every other run's work ended (its own placed
    workers stay, and the checks see where each one went). First fit, largest worker first, smallest machine
    first: it may miss a packing, never invents one."""
    job_id = requests[0].job_id
    visible = set(names)
    run_nodes = Counter(cluster.run_nodes.get(job_id, Counter()))
    group_nodes = {group: Counter(nodes) for (job, group), nodes in cluster.group_nodes.items() if job == job_id}
    room: dict[str, Free] = {}
    for request in sorted(requests, key=lambda r: (-r.gpus, -r.cpu, -r.memory_bytes, r.index)):
        ask = Ask(request, drives=drives)
        group = group_nodes.setdefault(request.group, Counter())
        if request.with_run:
            racks = Counter({r: c for n, c in run_nodes.items() if (r := _rack(cluster, n)) is not None})
            fabrics = frozenset(m.fabric for n in run_nodes if (m := cluster.machines.get(n)) and m.fabric)
            spread = Counter(group) if request.spread else Counter()
            ask = Ask(request, Counter(run_nodes), racks, spread, drives, fabrics)
        for name in cluster.by_size:
            if name not in visible:
                continue
            machine = cluster.machines[name]
            free = room.get(name) or _empty_but(cluster, name, job_id)
            if fits(machine, free, ask):
                room[name] = _less(free, request)
                run_nodes[name] += 1
                group[name] += 1
                break
        else:
            return False
    return True


def _rack(cluster: Cluster, name: str) -> str | None:
    machine = cluster.machines.get(name)
    return machine.rack if machine is not None else None


def _empty_but(cluster: Cluster, name: str, job_id: str) -> Free:
    """The machine's room with only the run's own workers on it."""
    machine = cluster.machines[name]
    free = Free(machine.cpus, machine.memory_bytes, len(machine.gpus))
    for alloc in cluster.held[name].values():
        if alloc.job_id == job_id:
            free = _less(free, alloc)
    return free


def _less(free: Free, taken: TaskRequest | Allocation) -> Free:
    return Free(free.cpu - taken.cpu, free.memory_bytes - taken.memory_bytes, free.gpus - taken.gpus)


def fits_empty(node: CompiledNode, ask: Ask) -> bool:
    """Whether the machine would take the worker once everything on it ended."""
    empty = Free(node.cpus, node.memory_bytes, len(node.gpus))
    return fits(node, empty, ask)
