"""What a waiting worker asks of the scheduler, from its run's spec."""

from __future__ import annotations

from tests.domain.builders import request
from workflows.domain.constraints import GpuRequest, NodeSelection
from workflows.domain.requests import request_fields
from workflows.domain.spec import parse_spec


def test_a_worker_asks_with_its_group_and_time_limit() -> None:
    spec = parse_spec({"name": "a", "groups": [{"name": "w", "command": ["x"]}]})
    group = spec.groups[0].model_copy(update={"time_limit_seconds": 60.0})
    fields = request_fields(spec, group)
    assert fields == {
        "group": "w",
        "time_limit_seconds": 60.0,
        "selection": None,
        "gpu_requests": (),
        "healthy_only": False,
        "topology": None,
    }
    limit = fields.pop("time_limit_seconds")
    assert request(limit=limit, **fields).time_limit_seconds == 60.0


def test_a_run_selection_and_a_group_selection_must_both_hold() -> None:
    run = NodeSelection(names=("a", "b"), labels={"zone": "x"}, pools=("p",))
    group = NodeSelection(names=("b", "c"), labels={"gpu": "h100"}, pools=("q",))
    assert run.merged(group) == NodeSelection(names=("b",), labels={"zone": "x", "gpu": "h100"}, pools=("p", "q"))
    assert run.merged(None) == run


def test_gpu_requests_say_what_they_accept() -> None:
    assert GpuRequest(models=("H100",)).describe() == "H100"
    assert GpuRequest(vendor="nvidia", models=("H100", "H200"), min_memory_bytes=80 * 10**9).describe() == (
        "nvidia H100 or H200 with at least 80 GB"
    )
    assert GpuRequest(min_memory_bytes=40 * 10**9).describe() == "matching with at least 40 GB"


def test_equal_needs_have_equal_shapes() -> None:
    assert request("w-0", run="a", gpus=2).shape == request("w-3", run="b", gpus=2, priority=5).shape
    assert request(gpus=2).shape != request(gpus=4).shape
