"""Placement: best fit in queue order, and, when nothing fits, every machine's reasons."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workflows.domain.nodes import GpuInfo, NodeInventory, NodeState, NodeView
from workflows.domain.placement import Allocation, Decision, Free, TaskRequest, free_capacity, place
from workflows.domain.reasons import Reason
from workflows.domain.status import NodeReasons

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)


def machine(
    name: str, *, cpus: float = 16, memory: int = 1 << 40, gpus: int = 0, state: NodeState = NodeState.READY
) -> NodeView:
    gpu_list = [GpuInfo(index=i, uuid=f"GPU-{name}-{i}", model="H100", memory_bytes=80 << 30) for i in range(gpus)]
    inventory = NodeInventory(name=name, cpus=cpus, memory_bytes=memory, gpus=gpu_list)
    return NodeView(name=name, state=state, inventory=inventory)


def unreported(name: str) -> NodeView:
    return NodeView(name=name, state=NodeState.READY, inventory=None)


def request(
    task: str = "w-0",
    *,
    job: str = "job/default/a",
    index: int = 0,
    priority: int = 0,
    submitted: int = 0,
    cpu: float = 1,
    memory: int = 0,
    gpus: int = 0,
) -> TaskRequest:
    return TaskRequest(
        job_id=job,
        namespace="default",
        task_id=task,
        index=index,
        attempt=0,
        priority=priority,
        submitted_at=T0 + timedelta(seconds=submitted),
        cpu=cpu,
        memory_bytes=memory,
        gpus=gpus,
    )


def holding(node: str, *, cpu: float = 0, memory: int = 0, gpus: int = 0, task: str = "x-0") -> Allocation:
    return Allocation(
        job_id="job/default/other", task_id=task, attempt=0, node=node, cpu=cpu, memory_bytes=memory, gpus=gpus
    )


def placed(decisions: list[Decision]) -> dict[str, str | None]:
    return {d.request.task_id: d.node for d in decisions}


# ---- where a request goes -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodes", "req", "node"),
    [
        pytest.param(
            [machine("big", gpus=8), machine("small", gpus=4)],
            request(gpus=2),
            "small",
            id="a request goes to the machine left with the fewest gpus",
        ),
        pytest.param(
            [machine("big", cpus=64), machine("small", cpus=8)],
            request(cpu=4),
            "small",
            id="with gpus equal the machine left with the fewest cpus wins",
        ),
        pytest.param(
            [machine("big", memory=1000), machine("small", memory=200)],
            request(cpu=1, memory=100),
            "small",
            id="with gpus and cpus equal the machine left with the least memory wins",
        ),
        pytest.param(
            [machine("b"), machine("a")],
            request(),
            "a",
            id="between equal machines the first by name wins",
        ),
        pytest.param(
            [machine("tight", gpus=1), machine("roomy", gpus=8)],
            request(gpus=2),
            "roomy",
            id="a machine without room is skipped",
        ),
        pytest.param(
            [machine("down", gpus=8, state=NodeState.DOWN), machine("up", gpus=8)],
            request(gpus=8),
            "up",
            id="a machine that is down takes nothing",
        ),
        pytest.param(
            [machine("n0", cpus=4)],
            request(cpu=4),
            "n0",
            id="a request that uses the whole machine fits",
        ),
    ],
)
def test_a_request_that_fits_goes_to_the_tightest_machine(nodes: list[NodeView], req: TaskRequest, node: str) -> None:
    assert place([req], nodes, []) == [Decision(req, node)]


# Each request asks for the whole machine, so only the head of the queue is placed.
@pytest.mark.parametrize(
    ("requests", "expected"),
    [
        pytest.param(
            [request("low", priority=1, submitted=0, gpus=8), request("high", priority=5, submitted=9, gpus=8)],
            {"high": "n0", "low": None},
            id="higher priority is placed first even when submitted later",
        ),
        pytest.param(
            [request("late", submitted=9, gpus=8), request("early", submitted=0, gpus=8)],
            {"early": "n0", "late": None},
            id="with equal priority the earlier submission is placed first",
        ),
        pytest.param(
            [request("second", index=1, gpus=8), request("first", index=0, gpus=8)],
            {"first": "n0", "second": None},
            id="within one run the lower worker index is placed first",
        ),
    ],
)
def test_queue_order(requests: list[TaskRequest], expected: dict[str, str | None]) -> None:
    assert placed(place(requests, [machine("n0", gpus=8)], [])) == expected


def test_decisions_come_in_queue_order() -> None:
    requests = [request("c", priority=0), request("a", priority=9), request("b", priority=5)]
    assert [d.request.task_id for d in place(requests, [machine("n0")], [])] == ["a", "b", "c"]


def test_a_placement_reduces_the_room_left_for_the_next_request() -> None:
    requests = [request("w-0", gpus=4), request("w-1", index=1, gpus=4), request("w-2", index=2, gpus=4)]
    decisions = place(requests, [machine("n0", gpus=8)], [])
    assert placed(decisions) == {"w-0": "n0", "w-1": "n0", "w-2": None}
    assert decisions[2].reason == Reason("NoMachineFits", "No machine fits: 1 of 1 machines ready")
    assert decisions[2].nodes == [NodeReasons(name="n0", reasons=["insufficient gpus: need 4, 0 free and usable"])]


# ---- why nothing fits -----------------------------------------------------------------------------------------


def test_no_machine_fits_lists_every_machine_sorted_by_name() -> None:
    nodes = [
        machine("n3", cpus=64, memory=50, gpus=8),
        machine("n1", cpus=64, gpus=4),
        machine("n2", cpus=16, gpus=8),
        machine("n0", gpus=8, state=NodeState.DOWN),
    ]
    req = request(cpu=32, memory=100, gpus=8)
    assert place([req], nodes, []) == [
        Decision(
            req,
            None,
            Reason("NoMachineFits", "No machine fits: 3 of 4 machines ready"),
            [
                NodeReasons(name="n0", reasons=["machine is not ready (Down)"]),
                NodeReasons(name="n1", reasons=["insufficient gpus: need 8, 4 free and usable"]),
                NodeReasons(name="n2", reasons=["insufficient cpu: need 32 cores, 16 free"]),
                NodeReasons(name="n3", reasons=["insufficient memory: need 100 bytes, 50 free"]),
            ],
        )
    ]


def test_no_machine_fits_one_of_two_ready() -> None:
    nodes = [machine("b", gpus=4), machine("a", gpus=8, state=NodeState.DOWN)]
    req = request(gpus=8)
    [decision] = place([req], nodes, [])
    assert decision.reason == Reason("NoMachineFits", "No machine fits: 1 of 2 machines ready")
    assert decision.nodes == [
        NodeReasons(name="a", reasons=["machine is not ready (Down)"]),
        NodeReasons(name="b", reasons=["insufficient gpus: need 8, 4 free and usable"]),
    ]


def test_a_machine_lists_every_resource_it_lacks_in_a_fixed_order() -> None:
    [decision] = place([request(cpu=32, memory=100, gpus=8)], [machine("n0", cpus=16, memory=50, gpus=4)], [])
    assert decision.nodes == [
        NodeReasons(
            name="n0",
            reasons=[
                "insufficient cpu: need 32 cores, 16 free",
                "insufficient memory: need 100 bytes, 50 free",
                "insufficient gpus: need 8, 4 free and usable",
            ],
        )
    ]


def test_fractional_cpu_is_written_without_trailing_zeros() -> None:
    [decision] = place([request(cpu=2.5)], [machine("n0", cpus=1.5)], [])
    assert decision.nodes == [NodeReasons(name="n0", reasons=["insufficient cpu: need 2.5 cores, 1.5 free"])]


def test_no_machines_registered() -> None:
    req = request()
    assert place([req], [], []) == [
        Decision(
            req,
            None,
            Reason("NoMachinesRegistered", "No machine fits: 0 of 0 machines ready: no machines are registered"),
            [],
        )
    ]


def test_a_machine_that_reports_no_capacity_says_so() -> None:
    [decision] = place([request()], [unreported("n0")], [])
    assert decision.nodes == [NodeReasons(name="n0", reasons=["machine is not ready (no capacity reported)"])]


def test_a_machine_that_reports_no_capacity_is_not_counted_as_ready() -> None:
    [decision] = place([request()], [unreported("n0")], [])
    assert decision.reason == Reason("NoMachineFits", "No machine fits: 0 of 1 machines ready")


# ---- allocations ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("allocations", "node", "reasons"),
    [
        pytest.param([], "n0", [], id="a machine holding nothing takes the request"),
        pytest.param(
            [holding("n0", gpus=6)],
            None,
            ["insufficient gpus: need 4, 2 free and usable"],
            id="gpus held by placed workers are not free",
        ),
        pytest.param(
            [holding("n0", cpu=14)],
            None,
            ["insufficient cpu: need 4 cores, 2 free"],
            id="cpus held by placed workers are not free",
        ),
        pytest.param(
            [holding("n0", memory=950)],
            None,
            ["insufficient memory: need 100 bytes, 50 free"],
            id="memory held by placed workers is not free",
        ),
        pytest.param(
            [holding("n0", gpus=10, task="x-0")],
            None,
            ["insufficient gpus: need 4, 0 free and usable"],
            id="an overcommitted machine shows 0 free rather than a negative count",
        ),
        pytest.param([holding("gone", gpus=8)], "n0", [], id="an allocation on an unknown machine is ignored"),
    ],
)
def test_allocations_reduce_the_free_room(allocations: list[Allocation], node: str | None, reasons: list[str]) -> None:
    [decision] = place([request(cpu=4, memory=100, gpus=4)], [machine("n0", memory=1000, gpus=8)], allocations)
    assert decision.node == node
    assert decision.nodes == ([NodeReasons(name="n0", reasons=reasons)] if reasons else [])


def test_free_capacity_subtracts_every_allocation() -> None:
    nodes = [machine("n0", cpus=16, memory=1000, gpus=8), unreported("n1")]
    allocations = [holding("n0", cpu=2, memory=100, gpus=1), holding("n0", cpu=1.5, memory=50, gpus=2, task="x-1")]
    assert free_capacity(nodes, allocations) == {"n0": Free(12.5, 850, 5), "n1": Free(0, 0, 0)}


# ---- property: never over capacity, one decision each ---------------------------------------------------------

# CPU in quarter cores so sums are exact in binary floating point.
quarters = st.integers(0, 64).map(lambda q: q / 4)


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[TaskRequest], list[NodeView], list[Allocation]]:
    names = draw(st.lists(st.sampled_from(["n0", "n1", "n2", "n3", "n4"]), unique=True, max_size=5))
    nodes = [
        machine(
            name,
            cpus=draw(quarters),
            memory=draw(st.integers(0, 1000)),
            gpus=draw(st.integers(0, 8)),
            state=draw(st.sampled_from([NodeState.READY, NodeState.READY, NodeState.DOWN])),
        )
        for name in names
    ]
    allocations = [
        holding(
            draw(st.sampled_from([*names, "gone"])),
            cpu=draw(quarters),
            memory=draw(st.integers(0, 500)),
            gpus=draw(st.integers(0, 4)),
            task=f"x-{i}",
        )
        for i in range(draw(st.integers(0, 6)))
    ]
    requests = [
        request(
            f"w-{i}",
            index=i,
            priority=draw(st.integers(0, 3)),
            submitted=draw(st.integers(0, 5)),
            cpu=draw(quarters),
            memory=draw(st.integers(0, 500)),
            gpus=draw(st.integers(0, 4)),
        )
        for i in range(draw(st.integers(0, 12)))
    ]
    return requests, nodes, allocations


@settings(max_examples=100, deadline=None, derandomize=True)
@given(clusters())
def test_place_never_overfills_a_machine_and_decides_once_per_request(
    cluster: tuple[list[TaskRequest], list[NodeView], list[Allocation]],
) -> None:
    requests, nodes, allocations = cluster
    decisions = place(requests, nodes, allocations)

    assert sorted(d.request.task_id for d in decisions) == sorted(r.task_id for r in requests)

    by_name = {n.name: n for n in nodes}
    held: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for a in allocations:
        held[a.node][0] += a.cpu
        held[a.node][1] += a.memory_bytes
        held[a.node][2] += a.gpus
    added: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for d in decisions:
        if d.node is None:
            assert d.reason is not None
            assert [n.name for n in d.nodes] == sorted(by_name)
            continue
        assert d.reason is None
        assert by_name[d.node].state is NodeState.READY
        added[d.node][0] += d.request.cpu
        added[d.node][1] += d.request.memory_bytes
        added[d.node][2] += d.request.gpus
    for name, (cpu, memory, gpus) in added.items():
        inv = by_name[name].inventory
        assert inv is not None
        # What placement adds never exceeds what was free (an already overcommitted machine takes nothing).
        assert cpu <= max(inv.cpus - held[name][0], 0)
        assert memory <= max(inv.memory_bytes - held[name][1], 0)
        assert gpus <= max(len(inv.gpus) - held[name][2], 0)
