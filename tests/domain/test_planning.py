"""Planning a group's GPUs across machines: one worker per machine, an even power-of-2 split, or the spec's
"Cannot plan workers: <why>"."""

from __future__ import annotations

import pytest

from tests.domain.builders import T0, holding, machine, request
from workflows.domain.inventory import NodeView
from workflows.domain.scheduling.planning import TaskPlan, plan_group, power_of_two

EIGHTS = [machine(f"n{i}", gpus=8) for i in range(4)]


def plan(total: int, machines: int | None, nodes: list[NodeView], **fields: object) -> TaskPlan:
    template = request(group="train", **fields)  # type: ignore[arg-type]
    return plan_group(template, total, machines, nodes, [holding("n3", gpus=4)], T0)


@pytest.mark.parametrize(
    ("total", "machines", "nodes", "fields", "reason"),
    [
        pytest.param(
            12, 5, EIGHTS, {}, "Cannot plan workers: cannot evenly distribute 12 gpus across 5 machines", id="uneven"
        ),
        pytest.param(
            24,
            2,
            EIGHTS,
            {},
            "Cannot plan workers: 24 gpus across 2 machines is 12 per worker, not a power of 2",
            id="not a power of 2",
        ),
        pytest.param(
            16,
            None,
            [machine(f"n{i}", gpus=4) for i in range(3)],
            {},
            "Cannot plan workers: no way to run 16 GPUs on these machines: 4 free on the largest one now",
            id="no way",
        ),
        pytest.param(
            16,
            4,
            [machine("a", gpus=8), machine("b", gpus=2)],
            {},
            "Cannot plan workers: no way to run 16 GPUs on these machines: 8 free on the largest one now",
            id="no way across the machines asked",
        ),
        pytest.param(
            8,
            None,
            EIGHTS,
            {"selection": {"labels": {"zone": "a"}}},
            "Cannot plan workers: no machine can host a worker of group train right now",
            id="no host",
        ),
    ],
)
def test_cannot_plan_workers(
    total: int, machines: int | None, nodes: list[NodeView], fields: dict[str, object], reason: str
) -> None:
    result = plan(total, machines, nodes, **fields)
    assert (result.workers, result.reason) == (0, reason)


@pytest.mark.parametrize(
    ("total", "machines", "fields", "expected"),
    [
        pytest.param(16, None, {}, (2, 8), id="as few machines as will take it"),
        pytest.param(16, 4, {}, (4, 4), id="exactly the machines asked"),
        pytest.param(4, None, {}, (1, 4), id="one machine when it fits"),
        pytest.param(24, None, {}, (3, 8), id="three machines of 8"),
        pytest.param(16, None, {"topology": {"max_machines": 1}}, (0, 0), id="at most one machine: no way"),
    ],
)
def test_a_plan_splits_evenly_in_powers_of_two(
    total: int, machines: int | None, fields: dict[str, object], expected: tuple[int, int]
) -> None:
    result = plan(total, machines, EIGHTS, **fields)
    assert (result.workers, result.gpus_per_worker) == expected


def test_the_largest_free_counts_only_machines_that_could_host_a_worker() -> None:
    nodes = [machine("a", gpus=8, labels={"zone": "b"}), machine("b", gpus=2, labels={"zone": "a"})]
    result = plan(16, None, nodes, selection={"labels": {"zone": "a"}})
    assert (
        result.reason == "Cannot plan workers: no way to run 16 GPUs on these machines: 2 free on the largest one now"
    )


def test_a_group_that_mounts_a_drive_is_planned_on_the_machines_that_could_take_it() -> None:
    from workflows.domain.constraints import Drive

    drives = {"imagenet": Drive(name="imagenet", size_bytes=2**30, node="n0", site="paris")}
    nodes = [machine("n0", gpus=8, site="paris"), machine("n1", gpus=8, site="lyon")]
    template = request(group="train", drives=("imagenet",))
    assert plan_group(template, 8, None, nodes, [], T0, drives=drives) == TaskPlan(workers=1, gpus_per_worker=8)
    assert plan_group(template, 16, None, nodes, [], T0, drives=drives).reason == (
        "Cannot plan workers: no way to run 16 GPUs on these machines: 8 free on the largest one now"
    )
    assert plan_group(template, 8, None, nodes, [], T0).reason == (
        "Cannot plan workers: no machine can host a worker of group train right now"
    )


@pytest.mark.parametrize(("n", "expected"), [(0, False), (1, True), (2, True), (6, False), (8, True), (12, False)])
def test_powers_of_two(n: int, expected: bool) -> None:
    assert power_of_two(n) is expected


def test_a_group_is_never_split_into_more_workers_than_a_run_may_have() -> None:
    ones = [machine(f"n{i}", gpus=1) for i in range(1024)]
    plan = plan_group(request(group="train"), 1024, None, ones, [], T0)
    assert (
        plan.reason == "Cannot plan workers: no way to run 1024 GPUs on these machines: 1 free on the largest one now"
    )


def test_memory_per_gpu_bounds_the_gpus_a_machine_can_take() -> None:
    """8 GPUs each, but room for 4 GiB per GPU on only 4 of them: 16 GPUs take four machines of 4, not two of 8."""
    nodes = [machine(f"n{i}", gpus=8, memory=16 * 2**30) for i in range(4)]
    result = plan_group(request(group="train", memory_per_gpu_bytes=4 * 2**30), 16, None, nodes, [], T0)
    assert (result.workers, result.gpus_per_worker) == (4, 4)
    result = plan_group(request(group="train", memory_per_gpu_bytes=4 * 2**30), 32, None, nodes, [], T0)
    assert result.reason == (
        "Cannot plan workers: no way to run 32 GPUs on these machines: 4 free on the largest one now"
    )
