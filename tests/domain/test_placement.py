"""Feasibility: each per-machine reason of the spec, whole, in its fixed order; best fit among machines that fit."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from tests.domain.builders import GB, T0, gpu, holding, ib, machine, request, unreported
from workflows.domain.constraints import Drive, GpuRequest, Network
from workflows.domain.inventory import DriveCopy, NetworkPort, NodeState, NodeView, PortRange
from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.scheduling.machines import Cluster, Free, free_capacity, size_text
from workflows.domain.scheduling.placement import CHECKS, ask_for, explain, fits
from workflows.domain.scheduling.queue import schedule


def reasons(
    node: NodeView,
    req: TaskRequest,
    allocations: list[Allocation] | None = None,
    drives: Mapping[str, Drive] | None = None,
) -> list[str]:
    # The run's other workers (in `allocations`) sit on n0, in rack r1, when the machine examined is another one.
    others = [machine("n0", labels=RACK)] if node.name != "n0" else []
    cluster = Cluster([node, *others], allocations or [], T0)
    ask = ask_for(req, cluster, drives or {})
    return [r.text for r in explain(cluster.machines[node.name], cluster.free[node.name], ask)]


def where(nodes: list[NodeView], req: TaskRequest, allocations: list[Allocation] | None = None) -> str | None:
    [decision] = schedule([req], nodes, allocations or [], T0).decisions
    return decision.node


# ---- every per-machine reason, whole ----------------------------------------------------------------------------

H100 = GpuRequest(models=("H100",))
NVIDIA_80 = GpuRequest(vendor="nvidia", models=("H100", "H200"), min_memory_bytes=80 * GB)
FAULTED = [gpu(0), gpu(1), gpu(2), gpu(3, fault="Xid 79 (GPU has fallen off the bus)")]
AT_RISK = [gpu(i, at_risk="retired pages pending" if i >= 6 else None) for i in range(8)]
RACK = {"topology.astraeus.io/rack": "r1"}


@pytest.mark.parametrize(
    ("node", "req", "allocations", "expected"),
    [
        pytest.param(machine("n0", state=NodeState.DOWN), request(), [], "machine is not ready (Down)", id="down"),
        pytest.param(unreported("n0"), request(), [], "machine is not ready (no capacity reported)", id="unreported"),
        pytest.param(
            machine("n0", pressure=["memory", "disk"]), request(), [], "under pressure: memory, disk", id="pressure"
        ),
        pytest.param(
            machine("n0", cordon="disk replacement"),
            request(),
            [],
            "machine is cordoned: disk replacement",
            id="cordon",
        ),
        pytest.param(
            machine("n0", refuses_runs="draining for an upgrade"),
            request(),
            [],
            "machine does not accept runs: draining for an upgrade",
            id="does not accept runs",
        ),
        pytest.param(
            machine("n0", accept_labels={"team": "vision"}, labels={"team": "nlp"}),
            request(selection={"labels": {"team": "nlp"}}),
            [],
            "worker carries none of the labels this machine accepts",
            id="accepted labels",
        ),
        pytest.param(
            machine("n0"),
            request(selection={"names": ["n1", "n2"]}),
            [],
            "machine is not among the selected names",
            id="names",
        ),
        pytest.param(
            machine("n0", labels={"zone": "b"}),
            request(selection={"labels": {"zone": "a"}}),
            [],
            "machine lacks label zone=a",
            id="label",
        ),
        pytest.param(
            machine("n0", pools=["batch"]),
            request(selection={"pools": ["training"]}),
            [],
            "machine lacks label pool.astraeus.io/name=training",
            id="pool",
        ),
        pytest.param(
            machine("n0", ports=[NetworkPort(name="mlx5_0", link="Ethernet", active=False)]),
            request(network=Network(rdma=True)),
            [],
            "no active RDMA port",
            id="rdma",
        ),
        pytest.param(
            machine("n0", ports=[ib("mlx5_0", speed=100), ib("mlx5_1", speed=400, active=False)]),
            request(network=Network(infiniband_gbps=200)),
            [],
            "no active InfiniBand port at 200 Gb/s or faster (mlx5_0 active at 100 Gb/s, mlx5_1 down at 400 Gb/s)",
            id="infiniband too slow or down",
        ),
        pytest.param(
            machine("n0"),
            request(network=Network(infiniband_gbps=200)),
            [],
            "no active InfiniBand port at 200 Gb/s or faster (no InfiniBand port)",
            id="no infiniband",
        ),
        pytest.param(
            machine("n0", ports=[ib("mlx5_0", fabric="ib-0"), ib("mlx5_1", speed=100, fabric="ib-1")]),
            request(network=Network(infiniband_gbps=200, fabric="ib-1")),
            [],
            "no active InfiniBand port at 200 Gb/s or faster (mlx5_0 active at 400 Gb/s on fabric ib-0, mlx5_1 active "
            "at 100 Gb/s on fabric ib-1)",
            id="infiniband on another fabric",
        ),
        pytest.param(
            machine("n0", ports=[ib("mlx5_0", fabric="ib-0"), ib("mlx5_1", active=False, fabric="ib-1")]),
            request(network=Network(fabric="ib-1")),
            [],
            "no active InfiniBand port on fabric ib-1 (mlx5_0 active at 400 Gb/s on fabric ib-0, mlx5_1 down at 400 "
            "Gb/s on fabric ib-1)",
            id="a fabric with no active port",
        ),
        pytest.param(
            machine("n0"),
            request("w-1", topology={"one_per_machine": True}),
            [holding("n0", run="a", task="w-0", group="w")],
            "another worker of this run is already on the machine",
            id="one per machine",
        ),
        pytest.param(machine("n0", cpus=16), request(cpu=32), [], "insufficient cpu: need 32 cores, 16 free", id="cpu"),
        pytest.param(
            machine("n0", memory=50), request(memory=100), [], "insufficient memory: need 100 bytes, 50 free", id="mem"
        ),
        pytest.param(
            machine("n0", gpus=8),
            request(gpus=8),
            [holding("n0", gpus=4)],
            "insufficient gpus: need 8, 4 free and usable",
        ),
        pytest.param(
            machine("n0", gpus=AT_RISK),
            request(gpus=8, healthy_only=True),
            [],
            "needs 8 healthy GPUs, 6 free (2 more free but at risk)",
            id="healthy only",
        ),
        pytest.param(
            machine("n0", gpus=[gpu(0, model="NVIDIA L4", memory=24 * GB)]),
            request(gpus=1, gpu_requests=(H100,)),
            [],
            "no H100 GPU",
            id="gpu model",
        ),
        pytest.param(
            machine("n0", gpus=[gpu(0, model="NVIDIA H100 PCIe", memory=40 * GB)]),
            request(gpus=1, gpu_requests=(NVIDIA_80,)),
            [],
            "no nvidia H100 or H200 with at least 80 GB GPU",
            id="gpu model and memory",
        ),
        pytest.param(
            machine("n0", gpus=FAULTED),
            request(gpus=1),
            [],
            "gpu fault on the machine: GPU 3: Xid 79 (GPU has fallen off the bus)",
            id="gpu fault",
        ),
        pytest.param(
            machine("n1"),
            request("w-1", topology={"one_machine": True}),
            [holding("n0", run="a", task="w-0", group="w")],
            "the run is kept on one machine, n0",
            id="one machine",
        ),
        pytest.param(
            machine("n1", labels={"topology.astraeus.io/rack": "r2"}),
            request("w-1", topology={"same_rack": True}),
            [holding("n0", run="a", task="w-0", group="w")],
            "the run is kept within rack r1",
            id="same rack",
        ),
        pytest.param(
            machine("n0"),
            request(topology={"same_rack": True}),
            [],
            "no rack set on this machine (topology.astraeus.io/rack)",
            id="no rack label",
        ),
        pytest.param(
            machine("n2"),
            request("w-2", topology={"max_machines": 2}),
            [holding("n0", run="a", task="w-0", group="w"), holding("n1", run="a", task="w-1", group="w")],
            "the run may use at most 2 machines",
            id="max machines",
        ),
        pytest.param(
            machine("n1", labels=RACK),
            request("w-1", topology={"one_per_rack": True}),
            [holding("n0", run="a", task="w-0", group="w")],
            "rack r1 already has a worker of this run",
            id="rack used",
        ),
        pytest.param(
            machine("n0"),
            request(capabilities=("outbound_policy",), drives=()),
            [],
            "machine cannot enforce an outbound policy (not reported by its agent)",
            id="outbound policy",
        ),
        pytest.param(
            machine("n0", capability_notes={"sandbox": "gVisor is not installed"}),
            request(capabilities=("sandbox",)),
            [],
            "machine cannot run sandboxed workers (gVisor is not installed)",
            id="sandbox",
        ),
        pytest.param(
            machine("n0", capability_notes={"tool_gateway": "no gateway configured"}),
            request(capabilities=("tool_gateway",)),
            [],
            "machine serves no tool gateway to its workers (no gateway configured)",
            id="tool gateway",
        ),
    ],
)
def test_each_per_machine_reason_is_the_spec_sentence(
    node: NodeView, req: TaskRequest, allocations: list[Allocation], expected: str
) -> None:
    assert reasons(node, req, allocations) == [expected]


MESH = Network(mesh=True)
NOT_MESHED = "its agent was started without --mesh-endpoint, so it is in no mesh between machines"


@pytest.mark.parametrize(
    ("node", "req", "expected"),
    [
        pytest.param(
            machine("n0", capabilities=["node_network"], capability_notes={"mesh": NOT_MESHED}),
            request(network=MESH),
            [f"machine cannot host the node network ({NOT_MESHED})"],
            id="a run that may span machines needs machines in the mesh",
        ),
        pytest.param(
            machine("n0", capabilities=["node_network", "mesh"]),
            request(network=MESH),
            [],
            id="a machine in the mesh takes it",
        ),
        pytest.param(
            machine("n0", capabilities=["node_network"], capability_notes={"mesh": NOT_MESHED}),
            request(network=MESH, topology={"one_machine": True}),
            [],
            id="a run kept on one machine needs no mesh",
        ),
        pytest.param(
            machine("n0", capability_notes={"node_network": "processes", "mesh": "processes"}),
            request(network=MESH),
            ["machine cannot host the node network (processes)"],
            id="a machine without the node network says so first",
        ),
    ],
)
def test_the_node_network_and_its_mesh(node: NodeView, req: TaskRequest, expected: list[str]) -> None:
    assert reasons(node, req) == expected


DRIVES = {
    "data": Drive(name="data", size_bytes=200 * 2**30, node="n9", site="paris"),
    "broken": Drive(name="broken", problem="its volume is being deleted"),
    "far": Drive(name="far", node="n8", site="tokyo"),
}


@pytest.mark.parametrize(
    ("drive", "inventory", "expected"),
    [
        pytest.param("nope", {}, "drive nope does not exist", id="missing"),
        pytest.param("broken", {}, "drive broken: its volume is being deleted", id="problem"),
        pytest.param("far", {"site": "paris"}, "drive far is on n8, in another site (tokyo)", id="other site"),
        pytest.param(
            "data",
            {"site": "paris", "data_free_bytes": 50 * 2**30},
            "drive data needs 200 GiB at this machine's data location, 50 GiB free",
            id="no space",
        ),
        pytest.param("data", {"site": "paris"}, "Choose where to keep data on n0", id="no data location"),
    ],
)
def test_drive_reasons(drive: str, inventory: dict[str, object], expected: str) -> None:
    assert reasons(machine("n0", **inventory), request(drives=(drive,)), drives=DRIVES) == [expected]


def test_a_drive_held_by_the_machine_itself_needs_no_copy() -> None:
    assert reasons(machine("n9", site="paris"), request(drives=("data",)), drives=DRIVES) == []


def test_copies_of_several_drives_must_fit_together() -> None:
    drives = {d: Drive(name=d, size_bytes=60 * 2**30, node="n9") for d in ("a", "b")}
    node = machine("n0", data_free_bytes=100 * 2**30)
    assert reasons(node, request(drives=("a", "b")), drives=drives) == [
        "drive b needs 60 GiB at this machine's data location, 40 GiB free"
    ]


def test_a_copy_filled_before_is_reused_and_needs_no_more_room() -> None:
    copy = DriveCopy(drive="data", path="/srv/data/astraeus-drives/data", size_bytes=200 * 2**30)
    node = machine("n0", site="paris", data_free_bytes=2**30, drive_copies=[copy])
    assert reasons(node, request(drives=("data",)), drives=DRIVES) == []
    far = machine("n0", site="lyon", data_free_bytes=2**30, drive_copies=[copy])
    assert reasons(far, request(drives=("data",)), drives=DRIVES) == ["drive data is on n9, in another site (paris)"]


@pytest.mark.parametrize(
    ("size", "text"), [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (200 * 2**30, "200 GiB"), (3 * 2**40, "3 TiB")]
)
def test_sizes_are_written_in_binary_units(size: int, text: str) -> None:
    assert size_text(size) == text


# ---- order, and what a machine says --------------------------------------------------------------------------


def test_a_machine_lists_every_reason_in_the_fixed_order() -> None:
    node = machine("n0", cpus=16, memory=50, gpus=4, pressure=["disk"], cordon="repairs", labels={"zone": "b"})
    req = request(cpu=32, memory=100, gpus=8, selection={"labels": {"zone": "a"}})
    assert reasons(node, req) == [
        "under pressure: disk",
        "machine is cordoned: repairs",
        "machine lacks label zone=a",
        "insufficient cpu: need 32 cores, 16 free",
        "insufficient memory: need 100 bytes, 50 free",
        "insufficient gpus: need 8, 4 free and usable",
    ]


def test_a_machine_that_is_not_ready_says_only_that() -> None:
    node = machine("n0", state=NodeState.DOWN, cpus=1, cordon="repairs")
    assert reasons(node, request(cpu=32)) == ["machine is not ready (Down)"]


def test_checks_run_cheap_first_in_the_spec_order() -> None:
    names = [check.__name__ for check in CHECKS]
    assert names[:3] == ["check_ready", "check_pressure", "check_open"]
    assert names.index("check_cpu") < names.index("check_gpus") < names.index("check_topology")
    assert names[-3:] == ["check_drives", "check_capabilities", "check_external_ports"]


def test_a_faulted_machine_still_takes_cpu_only_work() -> None:
    assert reasons(machine("n0", gpus=FAULTED), request(gpus=0)) == []


def test_gpus_at_risk_are_used_when_healthy_ones_are_not_asked_for() -> None:
    assert reasons(machine("n0", gpus=AT_RISK), request(gpus=8)) == []


def test_gpu_requests_count_only_matching_gpus() -> None:
    mixed = [gpu(0, model="NVIDIA L4"), gpu(1), gpu(2)]
    assert reasons(machine("n0", gpus=mixed), request(gpus=3, gpu_requests=(H100,))) == [
        "insufficient gpus: need 3, 2 free and usable"
    ]


def test_an_accepted_label_lets_selecting_work_in() -> None:
    node = machine("n0", accept_labels={"team": "vision"}, labels={"team": "vision"})
    assert reasons(node, request(selection={"labels": {"team": "vision"}})) == []


def test_fractional_cpu_is_written_without_trailing_zeros() -> None:
    assert reasons(machine("n0", cpus=1.5), request(cpu=2.5)) == ["insufficient cpu: need 2.5 cores, 1.5 free"]


@pytest.mark.parametrize(
    ("allocations", "expected"),
    [
        pytest.param([], [], id="a machine holding nothing takes the request"),
        pytest.param([holding("n0", gpus=6)], ["insufficient gpus: need 4, 2 free and usable"], id="gpus held"),
        pytest.param([holding("n0", cpu=14)], ["insufficient cpu: need 4 cores, 2 free"], id="cpus held"),
        pytest.param([holding("n0", memory=950)], ["insufficient memory: need 100 bytes, 50 free"], id="memory held"),
        pytest.param(
            [holding("n0", gpus=10)], ["insufficient gpus: need 4, 0 free and usable"], id="overcommitted shows 0 free"
        ),
        pytest.param([holding("gone", gpus=8)], [], id="an allocation on an unknown machine is ignored"),
    ],
)
def test_allocations_reduce_the_free_room(allocations: list[Allocation], expected: list[str]) -> None:
    assert reasons(machine("n0", memory=1000, gpus=8), request(cpu=4, memory=100, gpus=4), allocations) == expected


def test_free_capacity_subtracts_every_allocation() -> None:
    nodes = [machine("n0", cpus=16, memory=1000, gpus=8), unreported("n1")]
    allocations = [holding("n0", cpu=2, memory=100, gpus=1), holding("n0", cpu=1.5, memory=50, gpus=2, task="x-1")]
    assert free_capacity(nodes, allocations) == {"n0": Free(12.5, 850, 5), "n1": Free(0, 0, 0)}


# ---- best fit -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "req", "node"),
    [
        pytest.param(
            [machine("big", gpus=8), machine("small", gpus=4)], request(gpus=2), "small", id="fewest gpus left wins"
        ),
        pytest.param(
            [machine("big", cpus=64), machine("small", cpus=8)], request(cpu=4), "small", id="then fewest cpus left"
        ),
        pytest.param(
            [machine("big", memory=1000), machine("small", memory=200)],
            request(memory=100),
            "small",
            id="then least memory left",
        ),
        pytest.param([machine("b"), machine("a")], request(), "a", id="then the first by name"),
        pytest.param(
            [machine("tight", gpus=1), machine("roomy", gpus=8)], request(gpus=2), "roomy", id="no room is skipped"
        ),
        pytest.param(
            [machine("down", gpus=8, state=NodeState.DOWN), machine("up", gpus=8)],
            request(gpus=8),
            "up",
            id="a machine that is down takes nothing",
        ),
        pytest.param(
            [machine("a", gpus=2, cordon="repairs"), machine("b", gpus=8)], request(gpus=2), "b", id="cordoned skipped"
        ),
        pytest.param([machine("n0", cpus=4)], request(cpu=4), "n0", id="the whole machine fits"),
        pytest.param(
            [machine("a", gpus=8, labels={"zone": "x"}), machine("b", gpus=8, labels={"zone": "y"})],
            request(gpus=1, selection={"labels": {"zone": "y"}}),
            "b",
            id="selection is honoured",
        ),
    ],
)
def test_a_request_goes_to_the_tightest_machine_that_fits(nodes: list[NodeView], req: TaskRequest, node: str) -> None:
    assert where(nodes, req) == node


def test_fits_agrees_with_explain() -> None:
    cluster = Cluster([machine("n0", gpus=2)], [], T0)
    ask = ask_for(request(gpus=4), cluster, {})
    node, free = cluster.machines["n0"], cluster.free["n0"]
    assert not fits(node, free, ask)
    assert explain(node, free, ask)


@pytest.mark.parametrize(
    ("node", "asked", "expected"),
    [
        pytest.param(
            machine("n0"),
            1,
            ["machine exposes no external ports to its workers (its agent has no --external-ports range)"],
            id="a machine without a port range",
        ),
        pytest.param(
            machine("n0", external_ports=PortRange(first=30000, last=30001)),
            3,
            ["machine exposes no external ports to its workers (its range holds 2, the worker needs 3)"],
            id="a range smaller than the worker asks",
        ),
        pytest.param(machine("n0", external_ports=PortRange(first=30000, last=30001)), 2, [], id="a range enough"),
        pytest.param(machine("n0"), 0, [], id="no external access asks nothing"),
    ],
)
def test_external_access_needs_a_machine_that_assigns_ports(node: NodeView, asked: int, expected: list[str]) -> None:
    assert reasons(node, request(external_ports=asked)) == expected
