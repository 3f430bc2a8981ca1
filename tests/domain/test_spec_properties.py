"""Specs generated from the JSON Schema at its bounds and beyond: each is refused with an error naming the field, or
decided through the pure core (decide, planning, scheduling, effects, the queries' views) without raising.

Every field of the schema (numbers, strings, lists, mappings and their keys) gets values from its own minimum and
maximum, at the bound and just past it, and every number values far past anything sensible (1e300, 10**400,
infinity, NaN). One to three such
values are written into a valid base spec that has every field, and the result is submitted and driven: placed on a
small cluster, started, run, made stale, ended, restarted, its timers fired at their times.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.domain.builders import gpu, machine
from workflows.domain.run.effects import effects
from workflows.domain.run.events import (
    ArmTimer,
    Command,
    Created,
    Event,
    GroupPlanned,
    HeartbeatLate,
    Place,
    PlacementUpdate,
    PlanGroup,
    Start,
    Stop,
    TaskEnded,
    TaskReady,
    TaskRunning,
    TaskStarted,
    TimerFired,
)
from workflows.domain.run.job import decide
from workflows.domain.run.status import TASK_ENDED, TASK_ON_NODE, JobRecord, TaskState
from workflows.domain.run.tasks import allocation, new_job
from workflows.domain.run.views import describe, events
from workflows.domain.scheduling.planning import plan_group
from workflows.domain.scheduling.queue import schedule
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, parse_spec

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
SCHEMA = JobSpec.model_json_schema()
KEY = "<key>"  # a path step into a mapping: its first key in the base spec
EACH = -1  # a path step into a list: each of its items in the base spec
Path = tuple[str | int, ...]

# Valid bases that between them hold every field of the schema (test_every_bounded_field_is_reached checks it).
FULL: dict[str, Any] = {
    "name": "edge",
    "namespace": "default",
    "priority": 5,
    "lifetime": "Batch",
    "on_failure": "RestartTask",
    "node_selection": {"names": ["n0"], "labels": {"zone": "a"}, "pools": ["p"]},
    "topology": {"max_machines": 2, "patience_seconds": 60},
    "groups": [
        {
            "name": "w",
            "replicas": 2,
            "command": ["x"],
            "env": {"A": "1"},
            "cpu": 1,
            "memory_bytes": 1000,
            "gpus": 1,
            "time_limit_seconds": 60,
            "heartbeat_ttl_seconds": 30,
            "image": "img",
            "pull_policy": "Always",
            "registry_secret": "reg",
            "drives": [{"name": "d", "host_path": "/srv", "mount_path": "/d"}],
            "secrets": [{"name": "s", "key": "k", "env": "S"}],
            "gpu_requests": [{"vendor": "nvidia", "models": ["L4"], "min_memory_bytes": 1000}],
            "healthy_only": False,
            "node_selection": {"names": ["n0", "n1"], "labels": {"rack": "r"}, "pools": ["p"]},
            "readiness": {"command": ["true"], "period_seconds": 5, "timeout_seconds": 2},
            "depends_on": [{"group": "db"}],
            "array": {"max_parallel": 1},
        },
        {
            "name": "db",
            "command": ["x"],
            "total_gpus": 2,
            "machines": 1,
            "restart_policy": "Always",
            "per_gpu": {"memory_bytes": 1000},
        },
    ],
}
GANG: dict[str, Any] = {
    "name": "gang",
    "gang": True,
    "leader": "w-1",
    "min_available": 1,
    "on_failure": "RestartJob",
    "complete_with": "w",
    "topology": {"one_per_machine": True, "patience_seconds": 30},
    "groups": [
        {
            "name": "w",
            "replicas": 2,
            "command": ["x"],
            "gpus": 1,
            "time_limit_seconds": 60,
            "restart_policy": "Never",
            "per_gpu": {"memory_bytes": 1000},
            "network": {"rdma": True, "infiniband_gbps": 200, "fabric": "ib-0"},
            "capabilities": {"outbound_policy": {"allow": ["10.0.0.0/8", "pypi.org"]}, "sandbox": True},
        },
        {
            "name": "web",
            "command": ["x"],
            "readiness": {"http_get": {"port": 8080, "path": "/h"}},
            "external_access": [{"name": "web", "port": 8080}],
            "identity": True,
            "drives": [{"name": "v", "volume": "vol", "mount_path": "/v", "read_only": True}],
            "secrets": [{"name": "s", "key": "k", "path": "/run/k"}],
        },
    ],
}
BASES = (FULL, GANG)

L4 = [gpu(i, model="NVIDIA L4", memory=24 * 10**9) for i in range(8)]
LABELS = {"zone": "a", "rack": "r", "topology.astraeus.io/rack": "r"}
NODES = [
    machine("n0", cpus=64, gpus=L4, labels=LABELS, pools=["p"]),
    machine("n1", cpus=64, gpus=L4, labels=LABELS, pools=["p"]),
    machine("n2", cpus=8),
]


# ---- the schema's knobs and their edges -------------------------------------------------------------------------


def resolve(node: dict[str, Any]) -> dict[str, Any]:
    """A schema node with its $ref followed and an optional (anyOf with null) unwrapped."""
    if "$ref" in node:
        return resolve(SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]])
    branches = [b for b in node.get("anyOf", []) if b.get("type") != "null"]
    if len(branches) == 1:
        return resolve(branches[0])
    return node


def knobs(node: dict[str, Any], path: Path = ()) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every field under `node`, by path: properties by name, list items at EACH, mapping values at KEY."""
    node = resolve(node)
    yield path, node
    if node.get("type") == "object":
        for name, child in node.get("properties", {}).items():
            yield from knobs(child, (*path, name))
        if isinstance(node.get("additionalProperties"), dict):
            yield from knobs(node["additionalProperties"], (*path, KEY))
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        yield from knobs(node["items"], (*path, EACH))


def numbers(node: dict[str, Any]) -> list[Any]:
    """At each bound and just past it; and, bound or not, far past anything sensible."""
    integer = node.get("type") == "integer"
    values: list[Any] = []
    if "minimum" in node:
        low = node["minimum"]
        values += [low, low - 1] if integer else [low, math.nextafter(low, -math.inf)]
    if "exclusiveMinimum" in node:
        low = node["exclusiveMinimum"]
        values += [low, math.nextafter(low, math.inf)]
    if "maximum" in node:
        high = node["maximum"]
        values += [high, high + 1 if integer else math.nextafter(high, math.inf)]
    far: list[Any] = [10**400, 2**63, -(2**63), 10**18] if integer else [1e300, math.inf, -math.inf, math.nan, 1e-300]
    return values + far


def text(current: Any, length: int) -> str:
    """A string of `length` like the base's: an absolute path stays one, a name keeps its first character."""
    if isinstance(current, str) and current.startswith("/") and length > 1:
        return "/" + (current[1:2] or "a") * (length - 1)
    return (current[:1] if isinstance(current, str) and current else "a") * length


def many(current: Any, count: int) -> list[Any]:
    """`count` items like the base's first, told apart where they have a name, a path or a text."""
    items = []
    for i in range(count):
        item = copy.deepcopy(current)
        if isinstance(item, dict):
            for field in ("name", "mount_path", "group"):
                if isinstance(item.get(field), str) and field != "group":
                    item[field] = f"{item[field]}{i}" if field != "mount_path" else f"{item[field]}/{i}"
            if isinstance(item.get("env"), str):
                item["env"] = f"{item['env']}{i}"
        elif isinstance(item, str):
            item = f"{item}{i}"
        items.append(item)
    return items


def edges(node: dict[str, Any], current: Any) -> list[Any]:
    """Values of this field at its bounds and beyond, shaped like its value `current` in the base."""
    kind = node.get("type")
    values: list[Any] = []
    if kind in ("integer", "number"):
        values += numbers(node)
    if kind == "string":
        if "maxLength" in node:
            values += [text(current, node["maxLength"]), text(current, node["maxLength"] + 1)]
        if node.get("minLength"):
            values.append("")
    if kind == "array" and isinstance(current, list) and current:
        if "maxItems" in node:
            values += [many(current[0], node["maxItems"]), many(current[0], node["maxItems"] + 1)]
        if node.get("minItems"):
            values.append([])
    if kind == "object" and isinstance(current, dict) and current:
        key, value = next(iter(current.items()))
        if "maxProperties" in node:
            for count in (node["maxProperties"], node["maxProperties"] + 1):
                values.append({f"{key}{i}": value for i in range(count)})
        longest = node.get("propertyNames", {}).get("maxLength")
        if longest is not None:
            values += [{text(key, longest): value}, {text(key, longest + 1): value}]
        if node.get("propertyNames", {}).get("minLength"):
            values.append({"": value})
    return values


def lookup(data: Any, path: Path) -> tuple[bool, Any]:
    for step in path:
        if step == KEY:
            if not isinstance(data, dict) or not data:
                return False, None
            data = next(iter(data.values()))
        elif isinstance(step, int):
            if not isinstance(data, list) or len(data) <= step:
                return False, None
            data = data[step]
        else:
            if not isinstance(data, dict) or step not in data:
                return False, None
            data = data[step]
    return True, data


def assign(data: Any, path: Path, value: Any) -> bool:
    """Set the field at `path`; False when an earlier change took away where it was."""
    *parents, last = path
    found, parent = lookup(data, tuple(parents))
    if not found or not isinstance(parent, dict | list) or (last == KEY and not parent):
        return False
    if last == KEY:
        last = next(iter(parent))
    elif isinstance(parent, list) != isinstance(last, int) or (isinstance(last, int) and last >= len(parent)):
        return False
    parent[last] = value
    return True


def concrete(data: Any, path: Path) -> Iterator[Path]:
    """The paths of the base that `path` (with EACH steps) names."""
    if not path:
        yield ()
        return
    step, rest = path[0], path[1:]
    if step == EACH:
        for i, item in enumerate(data if isinstance(data, list) else []):
            yield from ((i, *tail) for tail in concrete(item, rest))
    else:
        found, child = lookup(data, (step,))
        if found:
            yield from ((step, *tail) for tail in concrete(child, rest))


KNOBS = [(path, node) for path, node in knobs(SCHEMA) if path]
# (base, field, path, value): every edge of every field, wherever the base holds it.
MUTATIONS = [
    (i, field, path, value)
    for i, base in enumerate(BASES)
    for field, node in KNOBS
    for path in concrete(base, field)
    for value in edges(node, lookup(base, path)[1])
]


# ---- the pure core, driven ------------------------------------------------------------------------------------------


def allocations(job: JobRecord) -> list[Any]:
    return [allocation(job, t) for t in job.tasks if t.node is not None and t.state not in TASK_ENDED]


def answer(job: JobRecord, commands: list[Command], now: datetime, timers: list[ArmTimer]) -> list[Event]:
    """The world's answers to a batch of commands: plans, placements, starts, a running report each, stop ends."""
    answers: list[Event] = []
    requests = []
    for command in commands:
        match command:
            case PlanGroup():
                plan = plan_group(command.request, command.total_gpus, command.machines, NODES, [], now)
                answers.append(GroupPlanned(group=command.group, **plan.model_dump()))
            case Place():
                requests += command.requests
            case Start(task_id=task, attempt=attempt, barrier=True):
                answers.append(TaskReady(task_id=task, attempt=attempt))
            case Start(task_id=task, attempt=attempt):
                answers += [TaskStarted(task_id=task, attempt=attempt), TaskRunning(task_id=task, attempt=attempt)]
            case Stop(task_id=task, attempt=attempt):
                answers.append(TaskEnded(task_id=task, attempt=attempt, exit_code=143))
            case ArmTimer():
                timers.append(command)
    if requests:
        plan = schedule(requests, NODES, allocations(job), now)
        for decision in plan.decisions:
            request, reason = decision.request, decision.reason
            answers.append(
                PlacementUpdate(task_id=request.task_id, attempt=request.attempt, node=decision.node)
                if decision.node is not None
                else PlacementUpdate(
                    task_id=request.task_id,
                    attempt=request.attempt,
                    code=reason.code if reason else "",
                    reason=reason.text if reason else "",
                )
            )
    return answers


def drive(spec: JobSpec, rounds: int = 30) -> None:
    """Submit the run and drive it: answers as the world would give them, then a missed heartbeat, then every
    worker on a machine exiting 1, and the timers fired at their times, earliest first."""
    now = T0
    job = new_job(spec, Settings(), now)
    inbox: list[Event] = [Created()]
    timers: list[ArmTimer] = []
    for round_ in range(rounds):
        on_node = [t for t in job.tasks if t.state in TASK_ON_NODE and t.state is not TaskState.STOPPING]
        if round_ == 4:
            inbox += [HeartbeatLate(task_id=t.id, attempt=t.attempt.number) for t in on_node]
        if round_ == 6:
            inbox += [
                TaskEnded(task_id=t.id, attempt=t.attempt.number, exit_code=1, log_tail="boom\n") for t in on_node
            ]
        if not inbox and timers:
            timers.sort(key=lambda timer: timer.at)
            timer = timers.pop(0)
            now = max(now, timer.at)
            inbox = [TimerFired(timer=timer.timer, task_id=timer.task_id, attempt=timer.attempt)]
        if not inbox:
            break
        job, commands = decide(job, inbox, now)
        inbox = answer(job, commands, now, timers)
        now += timedelta(seconds=1)
        # What a query reads, and what a run that continues as new starts from.
        describe(job)
        events(job)
        effects(job, now)
    # The scheduler as it looks again much later: limits of placed workers end (or not) by then.
    waiting = [t for t in job.tasks if t.state is TaskState.PENDING and not t.final]
    if waiting:
        answer(job, [Place(requests=[])], now + timedelta(days=400), timers)


# ---- properties ---------------------------------------------------------------------------------------------------

FIELD_FIRST = re.compile(r"^(?P<path>[a-z_]+(\.[^\s:]+)*)( key '[^']*')?: \S")
FIELDS = {name for _, node in knobs(SCHEMA) for name in node.get("properties", {})}
# Fields whose items a path names by key, by index, or (groups) by name: `groups.w0.depends_on`, `groups.0.env.A`.
CONTAINERS = {
    str(path[-1])
    for path, node in KNOBS
    if isinstance(node.get("additionalProperties"), dict) or node.get("type") == "array"
}


def names_a_field(line: str) -> bool:
    """`groups.0.env.A: ...`: a path of the spec's fields, list indices and a mapping's keys, then the problem."""
    match = FIELD_FIRST.match(line)
    if match is None:
        return False
    parts = match["path"].split(".")
    if parts[0] not in FIELDS:
        return False
    after_mapping = False
    for part in parts:
        if not (after_mapping or part.isdigit() or part in FIELDS):
            return False
        after_mapping = part in CONTAINERS
    return True


def check(data: dict[str, Any], fields: list[Path]) -> None:
    try:
        spec = parse_spec(data)
    except ValueError as error:
        for line in str(error).splitlines():
            assert names_a_field(line), f"a refusal that does not name a field first: {line!r} (set {fields})"
        return
    drive(spec)


def test_every_bounded_field_is_reached_by_a_base_spec() -> None:
    reached = {field for _, field, _, _ in MUTATIONS}
    assert [field for field, node in KNOBS if _bounded(node) and field not in reached] == []
    assert {("groups", EACH, "time_limit_seconds"), ("priority",), ("groups", EACH, "env")} <= reached


def _bounded(node: dict[str, Any]) -> bool:
    keys = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties"}
    return bool(keys & set(node))


def test_every_field_without_a_bound_is_one_that_needs_none() -> None:
    """Numbers, strings, lists and mappings all have bounds; only booleans, choices and patterned names do not."""
    loose = []
    for path, node in KNOBS:
        kind = node.get("type")
        if kind in ("integer", "number", "array") and not _bounded(node):
            loose.append(path)
        if kind == "string" and not ({"maxLength", "enum", "pattern", "const"} & set(node)):
            loose.append(path)
        mapping = kind == "object" and node.get("additionalProperties", False) is not False
        if mapping and "maxProperties" not in node:
            loose.append(path)
    assert loose == []


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3))
def test_a_spec_at_or_past_its_bounds_is_refused_naming_a_field_or_decided_without_raising(
    mutations: list[tuple[int, Path, Path, Any]],
) -> None:
    base = mutations[0][0]
    data = copy.deepcopy(BASES[base])
    fields = []
    for index, field, path, value in mutations:
        if index == base and assign(data, path, copy.deepcopy(value)):
            fields.append(field)
    check(data, fields)


def test_each_base_spec_is_valid_and_decided_without_raising() -> None:
    for base in BASES:
        drive(parse_spec(base))
