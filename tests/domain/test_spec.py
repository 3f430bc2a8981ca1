"""The run spec: defaults, and every refusal as one line naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from workflows.domain.requests import request_fields
from workflows.domain.spec import GroupSpec, JobSpec, job_id, parse_spec

NAME_RULE = "String should match pattern '^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$'"


def minimal() -> dict[str, Any]:
    return {"name": "hello", "groups": [{"name": "w", "command": ["echo", "hi"]}]}


def with_top(**fields: Any) -> dict[str, Any]:
    data = minimal()
    data.update(fields)
    return data


def with_group(**fields: Any) -> dict[str, Any]:
    data = minimal()
    data["groups"][0].update(fields)
    return data


def without_group_field(name: str) -> dict[str, Any]:
    data = minimal()
    del data["groups"][0][name]
    return data


# ---- valid specs ----------------------------------------------------------------------------------------------


def test_a_minimal_spec_gets_the_defaults() -> None:
    spec = parse_spec(minimal())
    assert spec == JobSpec(
        name="hello",
        namespace="default",
        priority=0,
        lifetime="Batch",
        groups=[
            GroupSpec(
                name="w",
                replicas=1,
                command=["echo", "hi"],
                image=None,
                env={},
                cpu=1.0,
                memory_bytes=0,
                gpus=0,
                restart_policy="OnFailure",
            )
        ],
    )


def test_every_built_field_is_kept() -> None:
    data = {
        "name": "train",
        "namespace": "research",
        "priority": 7,
        "lifetime": "Batch",
        "on_failure": "RestartJob",
        "gang": False,
        "leader": None,
        "min_available": None,
        "complete_with": "eval",
        "topology": {
            "one_machine": False,
            "same_rack": True,
            "one_per_rack": False,
            "one_per_machine": True,
            "max_machines": 4,
            "patience_seconds": 360.0,
        },
        "node_selection": {"names": ("n0", "n1"), "labels": {"zone": "a"}, "pools": ("training",)},
        "groups": [
            {
                "name": "trainer",
                "replicas": 4,
                "command": ["python", "train.py"],
                "image": "ghcr.io/acme/train:1",
                "env": {"SEED": "1"},
                "cpu": 8.5,
                "memory_bytes": 1 << 30,
                "gpus": 8,
                "total_gpus": None,
                "machines": None,
                "restart_policy": "Never",
                "pull_policy": "Always",
                "registry_secret": "regcred",
                "drives": [
                    {
                        "name": "data",
                        "host_path": "/mnt/data",
                        "volume": None,
                        "drive": None,
                        "mount_path": "/data",
                        "read_only": True,
                    },
                    {
                        "name": "cache",
                        "host_path": None,
                        "volume": "hf",
                        "drive": None,
                        "mount_path": "/cache",
                        "read_only": False,
                    },
                    {
                        "name": "imagenet",
                        "host_path": None,
                        "volume": None,
                        "drive": "imagenet",
                        "mount_path": "/imagenet",
                        "read_only": None,
                    },
                ],
                "secrets": [
                    {"name": "hf", "key": "token", "env": "HF_TOKEN", "path": None},
                    {"name": "db", "key": "password", "env": None, "path": "/run/secrets/db"},
                ],
                "time_limit_seconds": 3600.0,
                "heartbeat_ttl_seconds": 30.0,
                "gpu_requests": [{"vendor": "nvidia", "models": ("H100", "H200"), "min_memory_bytes": 80 * 10**9}],
                "healthy_only": True,
                "node_selection": {"names": (), "labels": {"gpu": "h100"}, "pools": ()},
                "per_gpu": None,
                "external_access": [{"name": "web", "port": 8080}],
                "identity": True,
                "depends_on": [],
                "array": None,
                "readiness": {
                    "command": None,
                    "http_get": {"port": 8080, "path": "/healthz"},
                    "period_seconds": 2.0,
                    "timeout_seconds": 1.0,
                },
                "network": {"rdma": False, "infiniband_gbps": 200, "fabric": "ib-0", "mesh": False},
                "capabilities": {
                    "outbound_policy": {"allow": ["10.0.0.0/8", "pypi.org"]},
                    "sandbox": True,
                    "tool_gateway": True,
                    "model_server": True,
                    "interactive_token": True,
                },
            },
            {
                "name": "eval",
                "command": ["eval"],
                "restart_policy": "Always",
                "depends_on": [{"group": "trainer", "condition": "healthy"}],
                "array": {"max_parallel": 1},
            },
        ],
    }
    eval_defaults = {
        "replicas": 1,
        "image": None,
        "env": {},
        "cpu": 1.0,
        "memory_bytes": 0,
        "gpus": 0,
        "time_limit_seconds": None,
        "heartbeat_ttl_seconds": None,
    }
    eval_defaults |= {"pull_policy": "IfNotPresent", "registry_secret": None, "drives": [], "secrets": []}
    eval_defaults |= {"gpu_requests": None, "healthy_only": False, "node_selection": None, "readiness": None}
    eval_defaults |= {"total_gpus": None, "machines": None, "per_gpu": None, "external_access": []}
    eval_defaults |= {"identity": False, "network": None, "capabilities": None}
    expected = data | {"groups": [data["groups"][0], data["groups"][1] | eval_defaults]}
    assert parse_spec(data).model_dump() == expected


def test_a_parsed_spec_round_trips_through_its_dump() -> None:
    spec = parse_spec(with_group(gpus=2, env={"A": "b"}))
    assert parse_spec(spec.model_dump()) == spec


def test_the_dump_leaves_out_the_fields_that_are_not_built() -> None:
    assert set(parse_spec(minimal()).groups[0].model_dump()) == {
        "name",
        "replicas",
        "command",
        "image",
        "env",
        "cpu",
        "memory_bytes",
        "gpus",
        "total_gpus",
        "machines",
        "restart_policy",
        "pull_policy",
        "registry_secret",
        "drives",
        "secrets",
        "time_limit_seconds",
        "heartbeat_ttl_seconds",
        "gpu_requests",
        "healthy_only",
        "node_selection",
        "depends_on",
        "array",
        "readiness",
        "per_gpu",
        "external_access",
        "identity",
        "network",
        "capabilities",
    }


@pytest.mark.parametrize(
    ("namespace", "name", "expected"),
    [
        pytest.param("default", "hello", "job/default/hello", id="the run's workflow id names namespace and run"),
        pytest.param("research", "train-1", "job/research/train-1", id="another namespace gets its own id"),
    ],
)
def test_job_id(namespace: str, name: str, expected: str) -> None:
    assert job_id(namespace, name) == expected
    assert parse_spec(with_top(namespace=namespace, name=name)).job_id == expected


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(with_group(network=None), id="an explicit null for a field not built is no value"),
        pytest.param(with_group(gpus=0, cpu=0), id="a worker may ask for no cpu and no gpu"),
        pytest.param(with_top(name="a"), id="a one-letter name is a name"),
        pytest.param(with_top(name="a" * 63), id="a 63-character name is a name"),
    ],
)
def test_edge_specs_that_are_valid(data: dict[str, Any]) -> None:
    parse_spec(data)


# ---- invalid specs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(with_top(foo=1), "foo: unknown field", id="an unknown top-level field is refused"),
        pytest.param(with_group(foo=1), "groups.0.foo: unknown field", id="an unknown group field is refused"),
        pytest.param(
            with_group(gpus=-1),
            "groups.0.gpus: Input should be greater than or equal to 0",
            id="negative gpus are refused",
        ),
        pytest.param(
            with_group(cpu=-1, gpus=-2),
            "groups.0.cpu: Input should be greater than or equal to 0\n"
            "groups.0.gpus: Input should be greater than or equal to 0",
            id="two problems are two lines",
        ),
        pytest.param(
            with_group(gpus=65),
            "groups.0.gpus: Input should be less than or equal to 64",
            id="more than 64 gpus per worker are refused",
        ),
        pytest.param(
            with_group(env={"SEED": 1}),
            "groups.0.env.SEED: Input should be a valid string",
            id="an environment value that is not a string is refused",
        ),
        pytest.param(
            with_group(memory_bytes=-1),
            "groups.0.memory_bytes: Input should be greater than or equal to 0",
            id="negative memory is refused",
        ),
        pytest.param(
            with_group(replicas=0),
            "groups.0.replicas: Input should be greater than or equal to 1",
            id="zero replicas are refused",
        ),
        pytest.param(without_group_field("command"), "groups.0.command: Field required", id="a group without command"),
        pytest.param(
            with_group(command=[]),
            "groups.0.command: List should have at least 1 item after validation, not 0",
            id="an empty command list is refused",
        ),
        pytest.param(
            with_group(command=["  ", "x"]),
            "groups.0.command: the program (first item) is empty",
            id="a blank program is refused",
        ),
        pytest.param(with_top(name="Bad_Name"), f"name: {NAME_RULE}", id="a name with capitals is refused"),
        pytest.param(with_top(name="-x"), f"name: {NAME_RULE}", id="a name starting with a dash is refused"),
        pytest.param(with_top(name="a" * 64), f"name: {NAME_RULE}", id="a 64-character name is refused"),
        pytest.param(with_top(namespace="A"), f"namespace: {NAME_RULE}", id="a bad namespace is refused"),
        pytest.param(with_group(name="w_1"), f"groups.0.name: {NAME_RULE}", id="a bad group name is refused"),
        pytest.param(
            with_top(priority=-1),
            "priority: Input should be greater than or equal to 0",
            id="a negative priority is refused",
        ),
        pytest.param(
            with_top(lifetime="Daemon"),
            "lifetime: Input should be 'Batch' or 'Service'",
            id="a lifetime is Batch or Service",
        ),
        pytest.param(
            with_group(restart_policy="Sometimes"),
            "groups.0.restart_policy: Input should be 'OnFailure', 'Always' or 'Never'",
            id="an unknown restart policy is refused",
        ),
        pytest.param(
            with_top(groups=[]),
            "groups: List should have at least 1 item after validation, not 0",
            id="a run without groups is refused",
        ),
        pytest.param({"groups": minimal()["groups"]}, "name: Field required", id="a run without a name"),
        pytest.param(["not", "a", "mapping"], "spec: expected a mapping of fields", id="a list is not a spec"),
    ],
)
def test_an_invalid_spec_raises_one_line_per_problem(data: Any, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_spec(data)
    assert str(raised.value) == message


# ---- bounds: every number, string and list has one, so nothing a user writes overflows a date or a timer ----------


def groups(count: int, **fields: Any) -> list[dict[str, Any]]:
    return [{"name": f"g{i}", "command": ["x"], **fields} for i in range(count)]


def labels(count: int, prefix: str = "k") -> dict[str, str]:
    return {f"{prefix}{i}": "v" for i in range(count)}


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(with_group(time_limit_seconds=365 * 86400), id="a time limit of a year is accepted"),
        pytest.param(with_group(heartbeat_ttl_seconds=86400), id="a heartbeat ttl of a day is accepted"),
        pytest.param(with_group(memory_bytes=4 * 2**50), id="4 PiB of memory per worker is accepted"),
        pytest.param(with_top(priority=1_000_000), id="priority 1000000 is accepted"),
        pytest.param(with_top(groups=groups(2, replicas=500)), id="a run of 1000 workers is accepted"),
        pytest.param(with_group(command=["x"] * 1024), id="a command of 1024 arguments is accepted"),
        pytest.param(with_group(env={"A": "x" * 32768, "B": "y" * 32762}), id="an env of 64 KiB is accepted"),
        pytest.param(with_top(topology={"patience_seconds": 86400}), id="a patience of a day is accepted"),
        pytest.param(with_top(node_selection={"labels": labels(256)}), id="256 selected labels are accepted"),
    ],
)
def test_values_at_their_bounds_are_accepted(data: dict[str, Any]) -> None:
    parse_spec(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            with_group(time_limit_seconds=1e300),
            "groups.0.time_limit_seconds: Input should be less than or equal to 31536000",
            id="a time limit past a year is refused (it would overflow a date)",
        ),
        pytest.param(
            with_group(time_limit_seconds=float("inf")),
            "groups.0.time_limit_seconds: Input should be less than or equal to 31536000",
            id="an infinite time limit is refused",
        ),
        pytest.param(
            with_group(time_limit_seconds=float("nan")),
            "groups.0.time_limit_seconds: Input should be less than or equal to 31536000",
            id="a time limit that is not a number is refused",
        ),
        pytest.param(
            with_group(heartbeat_ttl_seconds=86401),
            "groups.0.heartbeat_ttl_seconds: Input should be less than or equal to 86400",
            id="a heartbeat ttl past a day is refused",
        ),
        pytest.param(
            with_group(memory_bytes=10**400),
            "groups.0.memory_bytes: Input should be less than or equal to 4503599627370496",
            id="memory past 4 PiB is refused",
        ),
        pytest.param(
            with_group(gpu_requests=[{"min_memory_bytes": 2**60}]),
            "groups.0.gpu_requests.0.min_memory_bytes: Input should be less than or equal to 4503599627370496",
            id="GPU memory past 4 PiB is refused",
        ),
        pytest.param(
            with_top(priority=1_000_001),
            "priority: Input should be less than or equal to 1000000",
            id="a priority past a million is refused",
        ),
        pytest.param(
            with_top(groups=groups(2, replicas=501)),
            "groups: 1002 workers in all, at most 1000 in one run",
            id="a run of more than 1000 workers is refused",
        ),
        pytest.param(
            with_group(total_gpus=8, machines=1001),
            "groups.0.machines: Input should be less than or equal to 1000",
            id="a group split across more than 1000 machines is refused",
        ),
        pytest.param(
            with_group(command=["x"] * 1025),
            "groups.0.command: List should have at most 1024 items after validation, not 1025",
            id="a command of more than 1024 arguments is refused",
        ),
        pytest.param(
            with_group(command=["x", "y" * (32 * 1024 + 1)]),
            "groups.0.command.1: String should have at most 32768 characters",
            id="an argument past 32 KiB is refused",
        ),
        pytest.param(
            with_group(env={"A": "x" * 32768, "B": "y" * 32763}),
            "groups.0.env: 65537 bytes in all (names and values), at most 65536",
            id="an env past 64 KiB is refused",
        ),
        pytest.param(
            with_group(env={"": "x"}),
            "groups.0.env key '': String should have at least 1 character",
            id="an empty variable name is refused",
        ),
        pytest.param(
            with_group(image="x" * 513),
            "groups.0.image: String should have at most 512 characters",
            id="an image name past 512 characters is refused",
        ),
        pytest.param(
            with_group(drives=[{"name": "d", "host_path": "/" + "x" * 4096, "mount_path": "/d"}]),
            "groups.0.drives.0.host_path: String should have at most 4096 characters",
            id="a path past PATH_MAX is refused",
        ),
        pytest.param(
            with_top(topology={"patience_seconds": 1e300}),
            "topology.patience_seconds: Input should be less than or equal to 86400",
            id="a patience past a day is refused",
        ),
        pytest.param(
            with_top(topology={"max_machines": 1001}),
            "topology.max_machines: Input should be less than or equal to 1000",
            id="max_machines past the workers of a run is refused",
        ),
        pytest.param(
            with_top(gang=True, min_available=1001),
            "min_available: Input should be less than or equal to 1000",
            id="min_available past the workers of a run is refused",
        ),
        pytest.param(
            with_top(node_selection={"labels": labels(257)}),
            "node_selection.labels: Dictionary should have at most 256 items after validation, not more",
            id="more than 256 selected labels are refused",
        ),
        pytest.param(
            with_top(
                node_selection={"labels": labels(200)},
                groups=[{"name": "w", "command": ["x"], "node_selection": {"labels": labels(100, "j")}}],
            ),
            "groups.0.node_selection: with the run's node_selection, labels: Dictionary should have at most 256 "
            "items after validation, not more",
            id="a group's selection that with the run's selects more than 256 labels is refused",
        ),
    ],
)
def test_values_past_their_bounds_are_refused_naming_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_spec(data)
    assert str(raised.value) == message


def test_a_spec_larger_than_128_kib_is_refused_naming_its_largest_part() -> None:
    data = with_top(groups=[{"name": f"g{i}", "command": ["x" * (30000 + i)]} for i in range(5)])
    with pytest.raises(ValueError) as raised:
        parse_spec(data)
    assert str(raised.value) == (
        "groups.4: the run spec is 152676 bytes as JSON, at most 131072; this is its largest part (30495 bytes)"
    )


def test_duplicate_group_names_are_refused_naming_groups() -> None:
    data = with_top(groups=[{"name": "a", "command": ["x"]}, {"name": "a", "command": ["y"]}])
    with pytest.raises(ValueError) as raised:
        parse_spec(data)
    assert str(raised.value) == "groups: duplicate group name a"


def test_duplicate_group_names_are_refused() -> None:
    data = with_top(groups=[{"name": "a", "command": ["x"]}, {"name": "a", "command": ["y"]}])
    with pytest.raises(ValueError):  # the exact line is pinned by the xfail test above
        parse_spec(data)


# ---- per_gpu.memory_bytes: memory that scales with a worker's GPUs ------------------------------------------------


def test_per_gpu_memory_is_each_workers_gpus_times_it() -> None:
    group = parse_spec(with_group(gpus=4, per_gpu={"memory_bytes": 8 << 30})).groups[0]
    assert (group.per_gpu is not None, group.memory_bytes, group.worker_memory_bytes) == (True, 0, 32 << 30)
    assert parse_spec(with_group(gpus=2, memory_bytes=1 << 30)).groups[0].worker_memory_bytes == 1 << 30


@pytest.mark.parametrize(
    ("group", "message"),
    [
        pytest.param(
            {"gpus": 1, "memory_bytes": 1 << 30, "per_gpu": {"memory_bytes": 1 << 30}},
            "groups.0: per_gpu.memory_bytes: set memory_bytes or per_gpu.memory_bytes, not both",
            id="memory per worker and per GPU are one or the other",
        ),
        pytest.param(
            {"per_gpu": {"memory_bytes": 1 << 30}},
            "groups.0: per_gpu.memory_bytes: the group asks for no GPUs (set gpus or total_gpus, or memory_bytes)",
            id="memory per GPU needs GPUs",
        ),
        pytest.param(
            {"gpus": 1, "per_gpu": {"memory_bytes": 0}},
            "groups.0.per_gpu.memory_bytes: Input should be greater than 0",
            id="memory per GPU is more than nothing",
        ),
        pytest.param(
            {"gpus": 1, "per_gpu": {"memory_bytes": 1, "cpu": 2}},
            "groups.0.per_gpu.cpu: unknown field",
            id="per_gpu has memory_bytes only",
        ),
        pytest.param(
            {"gpus": 64, "per_gpu": {"memory_bytes": 1 << 50}},
            "groups.0: per_gpu.memory_bytes: 64 GPUs x 1125899906842624 bytes is more than 4503599627370496 bytes",
            id="a worker's memory per GPU stays within the bound of memory_bytes",
        ),
    ],
)
def test_per_gpu_memory_is_refused_naming_the_field(group: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_spec(with_group(**group))
    assert str(raised.value) == message


def test_a_group_of_total_gpus_may_ask_memory_per_gpu() -> None:
    group = parse_spec(with_group(total_gpus=8, per_gpu={"memory_bytes": 1 << 30})).groups[0]
    assert group.worker_memory_bytes == 0  # not planned yet: its workers' GPUs, and so their memory, come with the plan


def test_the_second_group_is_named_by_its_index() -> None:
    data = minimal()
    data["groups"].append(copy.deepcopy(data["groups"][0]) | {"name": "x", "gpus": -1})
    with pytest.raises(ValueError) as raised:
        parse_spec(data)
    assert str(raised.value) == "groups.1.gpus: Input should be greater than or equal to 0"


# ---- machines: image pulls, drives, secrets -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "message"),
    [
        pytest.param(
            {"pull_policy": "Never"},
            "groups.0.pull_policy: Input should be 'Always', 'IfNotPresent' or 'None'",
            id="a pull policy is Always, IfNotPresent or None",
        ),
        pytest.param(
            {"drives": [{"name": "d", "host_path": "data", "mount_path": "/data"}]},
            "groups.0.drives.0.host_path: 'data' is not an absolute path",
            id="a host path is absolute",
        ),
        pytest.param(
            {"drives": [{"name": "d", "host_path": "/mnt/../etc", "mount_path": "/data"}]},
            "groups.0.drives.0.host_path: '/mnt/../etc' is not a normal path (write it as '/etc')",
            id="a host path has no dot-dot",
        ),
        pytest.param(
            {"drives": [{"name": "d", "volume": "v", "mount_path": "/"}]},
            "groups.0.drives.0.mount_path: '/' cannot be mounted over",
            id="nothing is mounted over the root",
        ),
        pytest.param(
            {"drives": [{"name": "d", "volume": "v", "host_path": "/mnt", "mount_path": "/data"}]},
            "groups.0.drives.0: set exactly one of host_path, volume and drive",
            id="a drive is a host path or a volume, not both",
        ),
        pytest.param(
            {"drives": [{"name": "d", "drive": "imagenet", "mount_path": "/data", "read_only": False}]},
            "groups.0.drives.0: read_only: a placed drive's copy is shared by the machine's workers; it is read-only",
            id="a placed drive is never writable",
        ),
        pytest.param(
            {"drives": [{"name": "d", "drive": "Imagenet", "mount_path": "/data"}]},
            "groups.0.drives.0.drive: String should match pattern '^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$'",
            id="a placed drive is named as the catalogue names it",
        ),
        pytest.param(
            {"drives": [{"name": "d", "volume": "-v", "mount_path": "/data"}]},
            "groups.0.drives.0.volume: String should match pattern '^[A-Za-z0-9][A-Za-z0-9_.-]*$'",
            id="a volume has a name the engine accepts",
        ),
        pytest.param(
            {
                "drives": [
                    {"name": "a", "volume": "v", "mount_path": "/d"},
                    {"name": "b", "volume": "w", "mount_path": "/d"},
                ]
            },
            "groups.0: drives and secrets: /d mounted twice",
            id="two drives at one path",
        ),
        pytest.param(
            {
                "drives": [
                    {"name": "a", "volume": "v", "mount_path": "/d"},
                    {"name": "a", "volume": "w", "mount_path": "/e"},
                ]
            },
            "groups.0: drives: duplicate drive name a",
            id="two drives of one name",
        ),
        pytest.param(
            {"secrets": [{"name": "hf", "key": "token"}]},
            "groups.0.secrets.0: set exactly one of env and path",
            id="a secret is a variable or a file",
        ),
        pytest.param(
            {"secrets": [{"name": "hf", "key": "../token", "env": "T"}]},
            "groups.0.secrets.0.key: String should match pattern '^[A-Za-z0-9_][-._A-Za-z0-9]*$'",
            id="a secret's key is a file name",
        ),
        pytest.param(
            {"env": {"T": "1"}, "secrets": [{"name": "hf", "key": "token", "env": "T"}]},
            "groups.0: secrets: T set twice (by env or another secret)",
            id="a secret's variable is not also in env",
        ),
        pytest.param(
            {"registry_secret": "Reg Cred"},
            f"groups.0.registry_secret: {NAME_RULE}",
            id="a registry secret has a name",
        ),
    ],
)
def test_a_bad_drive_secret_or_pull_policy_is_refused_naming_the_field(group: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_spec(with_group(**group))
    assert str(raised.value) == message


def test_a_run_on_the_node_network_may_span_machines() -> None:
    spec = parse_spec({**with_group(network={"mesh": True}, replicas=2), "topology": {"one_per_machine": True}})
    assert spec.groups[0].network is not None and spec.groups[0].network.mesh


@pytest.mark.parametrize("topology", [{"one_machine": True}, {}], ids=["on one machine", "on several"])
def test_a_gang_joins_the_node_network(topology: dict[str, Any]) -> None:
    spec = parse_spec({**with_group(network={"mesh": True}, replicas=2), "gang": True, "topology": topology})
    assert spec.gang and spec.groups[0].network is not None and spec.groups[0].network.mesh


def test_a_gangs_groups_ask_for_the_node_network_all_or_none() -> None:
    groups = [
        {"name": "leader", "command": ["true"], "network": {"mesh": True}},
        {"name": "rest", "command": ["true"], "replicas": 2},
    ]
    with pytest.raises(ValueError) as raised:
        parse_spec({"name": "mixed", "gang": True, "groups": groups})
    assert str(raised.value) == (
        "groups.1.network.mesh: a gang's groups ask for the node network all or none (its workers meet at "
        "MASTER_ADDR, the leader's address there or on its machine's own network); group rest does not ask it, "
        "group leader does"
    )
    assert not parse_spec({"name": "mixed", "groups": groups}).gang  # not a gang: each group as it asks


def test_a_run_kept_on_one_machine_joins_the_node_network() -> None:
    spec = parse_spec({**with_group(network={"mesh": True}), "topology": {"one_machine": True}})
    assert spec.groups[0].network is not None and spec.groups[0].network.mesh


@pytest.mark.parametrize(
    "network",
    [
        pytest.param({"rdma": True}, id="any RDMA port"),
        pytest.param({"infiniband_gbps": 200}, id="InfiniBand at a speed"),
        pytest.param({"infiniband_gbps": 200, "fabric": "ib-0"}, id="InfiniBand on a fabric"),
    ],
)
def test_a_network_request_is_accepted_and_reaches_the_scheduler(network: dict[str, Any]) -> None:
    spec = parse_spec(with_group(network=network))
    assert spec.groups[0].network is not None
    assert spec.groups[0].network.model_dump(exclude_defaults=True) == network
    assert request_fields(spec, spec.groups[0])["network"] == spec.groups[0].network


@pytest.mark.parametrize(
    ("capabilities", "message"),
    [
        pytest.param(
            {"interactive_token": "always"},
            "groups.0.capabilities.interactive_token: Input should be a valid boolean, unable to interpret input",
            id="an interactive token is asked with true or false",
        ),
        pytest.param(
            {"outbound_policy": {"allow": ["10.0.0"]}},
            "groups.0.capabilities.outbound_policy.allow: '10.0.0' is neither an address, a network (10.0.0.0/8) nor "
            "a host name",
            id="an outbound policy names addresses, networks and host names",
        ),
        pytest.param(
            {"outbound_policy": {"allow": []}},
            "groups.0.capabilities.outbound_policy.allow: List should have at least 1 item after validation, not 0",
            id="an outbound policy allows something",
        ),
        pytest.param({"gpu_direct": True}, "groups.0.capabilities.gpu_direct: unknown field", id="unknown one"),
    ],
)
def test_a_bad_capability_is_refused_naming_it(capabilities: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_spec(with_group(capabilities=capabilities))
    assert str(raised.value) == message


def test_capabilities_reach_the_scheduler_as_what_it_checks_on_each_machine() -> None:
    wanted = {"outbound_policy": {"allow": ["192.0.2.7", "10.1.0.0/16", "PyPI.org"]}, "model_server": True}
    spec = parse_spec(with_group(capabilities=wanted | {"sandbox": True, "tool_gateway": True}))
    capabilities = spec.groups[0].capabilities
    assert capabilities is not None and capabilities.outbound_policy is not None
    assert capabilities.outbound_policy.allow == ["192.0.2.7/32", "10.1.0.0/16", "pypi.org"]
    checked = request_fields(spec, spec.groups[0])["capabilities"]
    assert checked == ("outbound_policy", "sandbox", "tool_gateway")  # a model server is set up by the machine only
    served = parse_spec(with_group(capabilities={"model_server": True}))
    assert request_fields(served, served.groups[0])["capabilities"] == ()


def test_an_interactive_token_is_accepted_and_set_up_by_the_machine_only() -> None:
    spec = parse_spec(with_group(capabilities={"interactive_token": True}))
    capabilities = spec.groups[0].capabilities
    assert capabilities is not None and capabilities.interactive_token is True
    assert request_fields(spec, spec.groups[0])["capabilities"] == ()  # no machine is kept out for it


# ---- gangs, groups that wait, services, planning ------------------------------------------------------------------


def _groups(*groups: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"name": "r", "groups": [{"command": ["x"]} | g for g in groups]} | top


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(
            _groups({"name": "a", "depends_on": [{"group": "b"}]}),
            "groups.a.depends_on: no group named b",
            id="depends_on names a group of the run",
        ),
        pytest.param(
            _groups({"name": "a", "depends_on": [{"group": "a"}]}),
            "groups.a.depends_on: a group cannot wait for itself",
            id="a group cannot wait for itself",
        ),
        pytest.param(
            _groups({"name": "a", "depends_on": [{"group": "b"}]}, {"name": "b", "depends_on": [{"group": "a"}]}),
            "depends_on: the groups wait for each other in a cycle: a -> b -> a",
            id="depends_on has no cycle",
        ),
        pytest.param(
            _groups({"name": "a", "depends_on": [{"group": "b", "condition": "healthy"}]}, {"name": "b"}),
            "groups.a.depends_on: group b has no readiness check, so it is never healthy "
            "(wait for running, or give it a readiness check)",
            id="healthy needs a readiness check",
        ),
        pytest.param(
            _groups({"name": "a", "readiness": {"command": ["x"], "http_get": {"port": 80}}}),
            "groups.0.readiness: set exactly one of command and http_get",
            id="a readiness check is a command or an HTTP GET",
        ),
        pytest.param(
            _groups({"name": "a"}, complete_with="b"),
            "complete_with: no group named b",
            id="complete_with names a group",
        ),
        pytest.param(
            _groups({"name": "a"}, complete_with="a", lifetime="Service"),
            "complete_with: a Service run does not complete; use lifetime Batch",
            id="a service does not complete",
        ),
        pytest.param(_groups({"name": "a"}, leader="a-0"), "leader: only a gang has one (set gang: true)", id="leader"),
        pytest.param(
            _groups({"name": "a", "replicas": 2}, gang=True, leader="a-2"),
            "leader: no worker named a-2 (workers are named <group>-<index>)",
            id="the leader is a worker of the run",
        ),
        pytest.param(
            _groups({"name": "a", "replicas": 2}, gang=True, min_available=3),
            "min_available: 3 is more than the run's 2 workers",
            id="min_available is at most the workers",
        ),
        pytest.param(
            _groups({"name": "a"}, {"name": "b", "depends_on": [{"group": "a"}]}, gang=True),
            "groups.b.depends_on: a gang starts every worker together",
            id="a gang has no depends_on",
        ),
        pytest.param(
            _groups({"name": "a", "total_gpus": 16, "gpus": 8}),
            "groups.0: total_gpus: the scheduler sets the workers and their GPUs; leave out gpus",
            id="total_gpus leaves the split to the scheduler",
        ),
        pytest.param(
            _groups({"name": "a", "machines": 2}),
            "groups.0: machines: only with total_gpus",
            id="machines only with total_gpus",
        ),
    ],
)
def test_a_run_that_cannot_hold_together_is_refused(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_spec(data)
    assert str(raised.value) == message


def test_a_gang_defaults_to_restart_job_and_its_first_worker_leads() -> None:
    spec = parse_spec(_groups({"name": "a", "replicas": 2}, gang=True))
    assert (spec.failure_policy, spec.leader_id) == ("RestartJob", "a-0")
    assert parse_spec(_groups({"name": "a"})).failure_policy == "RestartTask"


# ---- external_access: ports a worker listens on, exposed on its machine -------------------------------------------


@pytest.mark.parametrize(
    ("access", "message"),
    [
        pytest.param(
            [{"name": "web", "port": 8080}, {"name": "web", "port": 8081}],
            "groups.0: external_access: name web given twice",
            id="each external access has its own name",
        ),
        pytest.param(
            [{"name": "a", "port": 8080}, {"name": "b", "port": 8080}],
            "groups.0: external_access: port 8080 given twice",
            id="each external access has its own port",
        ),
        pytest.param(
            [{"name": "web", "port": 0}],
            "groups.0.external_access.0.port: Input should be greater than or equal to 1",
            id="a port is 1 or more",
        ),
        pytest.param([{"name": "Web", "port": 80}], f"groups.0.external_access.0.name: {NAME_RULE}", id="a name"),
        pytest.param(
            [{"name": f"p{i}", "port": 8000 + i} for i in range(17)],
            "groups.0.external_access: List should have at most 16 items after validation, not 17",
            id="at most 16 ports a worker",
        ),
    ],
)
def test_external_access_is_refused_naming_the_field(access: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        parse_spec(with_group(external_access=access))
    assert str(raised.value) == message


def test_external_access_names_its_variables() -> None:
    group = parse_spec(with_group(external_access=[{"name": "web-ui", "port": 8080}])).groups[0]
    assert [(a.variable, a.port) for a in group.external_access] == [("WEB_UI", 8080)]
