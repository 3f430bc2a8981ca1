"""What a waiting worker asks of the scheduler, from its run's spec."""

from __future__ import annotations

import pytest

from tests.domain.builders import T0, machine, request
from workflows.domain.constraints import GpuRequest, NodeSelection
from workflows.domain.requests import request_fields
from workflows.domain.run.tasks import allocation, groups_of, new_job, plan_tasks, task_request
from workflows.domain.scheduling.machines import Cluster
from workflows.domain.scheduling.placement import ask_for, explain
from workflows.domain.settings import Settings
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
        "network": None,
        "capabilities": (),
        "topology": None,
        "max_parallel": None,
        "gang": False,
        "min_available": None,
        "spread": False,
        "drives": (),
        "memory_per_gpu_bytes": 0,
        "external_ports": 0,
    }
    limit = fields.pop("time_limit_seconds")
    assert request(limit=limit, **fields).time_limit_seconds == 60.0


def test_a_worker_asks_for_the_catalogue_drives_its_group_mounts_and_holds_them_once_placed() -> None:
    from workflows.domain.requests import allocation_for

    drives = [
        {"name": "data", "drive": "imagenet", "mount_path": "/data"},
        {"name": "cache", "volume": "hf", "mount_path": "/cache"},
        {"name": "weights", "drive": "llama", "mount_path": "/weights"},
    ]
    spec = parse_spec({"name": "a", "groups": [{"name": "w", "command": ["x"], "drives": drives}]})
    fields = request_fields(spec, spec.groups[0])
    assert fields["drives"] == ("imagenet", "llama")
    asked = request(**{k: v for k, v in fields.items() if k != "time_limit_seconds"})
    assert asked.drives == ("imagenet", "llama")
    assert allocation_for(asked, "n0", asked.submitted_at).drives == ("imagenet", "llama")


def test_a_gang_and_an_array_ask_as_such() -> None:
    spec = parse_spec(
        {
            "name": "a",
            "gang": True,
            "min_available": 2,
            "groups": [{"name": "w", "replicas": 3, "command": ["x"]}],
        }
    )
    fields = request_fields(spec, spec.groups[0])
    assert (fields["gang"], fields["min_available"], fields["max_parallel"]) == (True, 2, None)
    array = parse_spec({"name": "b", "groups": [{"name": "w", "command": ["x"], "array": {"max_parallel": 4}}]})
    assert request_fields(array, array.groups[0])["max_parallel"] == 4


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


def test_the_spec_fields_placement_honours_reach_the_request() -> None:
    spec = parse_spec(
        {
            "name": "a",
            "topology": {"same_rack": True, "patience_seconds": 360},
            "node_selection": {"pools": ["training"]},
            "groups": [
                {
                    "name": "w",
                    "command": ["x"],
                    "gpus": 8,
                    "gpu_requests": [{"vendor": "nvidia", "model": "H100"}],
                    "healthy_only": True,
                    "node_selection": {"labels": {"zone": "a"}},
                }
            ],
        }
    )
    fields = request_fields(spec, spec.groups[0])
    assert fields["selection"] == NodeSelection(labels={"zone": "a"}, pools=("training",))
    assert fields["gpu_requests"] == (GpuRequest(vendor="nvidia", models=("H100",)),)
    assert fields["healthy_only"] is True
    assert fields["topology"] is not None and fields["topology"].patience_seconds == 360


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "topology",
            {"one_machine": True, "one_per_machine": True},
            "topology: one_machine cannot be combined with one_per_machine or one_per_rack",
        ),
        ("topology", {"max_machines": 0}, "topology.max_machines: Input should be greater than or equal to 1"),
        ("node_selection", {"hosts": ["n0"]}, "node_selection.hosts: unknown field"),
    ],
)
def test_placement_fields_are_checked_at_submit(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_spec({"name": "a", field: value, "groups": [{"name": "w", "command": ["x"]}]})
    assert str(raised.value) == message


def test_a_gpu_request_takes_a_model_or_models_but_not_both() -> None:
    with pytest.raises(ValueError):
        GpuRequest.model_validate({"model": "H100", "models": ["H200"]})


def test_a_worker_with_memory_per_gpu_asks_and_holds_its_gpus_times_it() -> None:
    per_gpu = 3 * 2**30
    spec = parse_spec(
        {"name": "a", "groups": [{"name": "w", "command": ["x"], "gpus": 4, "per_gpu": {"memory_bytes": per_gpu}}]}
    )
    job = new_job(spec, Settings(), T0)
    job.tasks = plan_tasks(groups_of(job), T0)
    asked = task_request(job, job.tasks[0])
    assert (asked.memory_bytes, asked.memory_per_gpu_bytes) == (4 * per_gpu, per_gpu)
    node = machine("n0", gpus=8, memory=8 * 2**30)
    cluster = Cluster([node], [], T0)
    why = explain(cluster.machines["n0"], cluster.free["n0"], ask_for(asked, cluster, {}))
    assert [r.text for r in why] == ["insufficient memory: need 12884901888 bytes, 8589934592 free"]
    placed = job.tasks[0].model_copy(update={"attempt": job.tasks[0].attempt.model_copy(update={"node": "n0"})})
    assert allocation(job, placed).memory_bytes == 4 * per_gpu
