"""The run spec a user submits (the API calls it a job spec), with the spec's field names.

Unknown fields are errors, and so are fields the spec names that Astraeus does not honour yet: a field that is
accepted is honoured.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from workflows.domain.bounds import (
    ENV_MAX_BYTES,
    ENV_MAX_VARIABLES,
    IMAGE_MAX_CHARS,
    LEADER_MAX_CHARS,
    MAX_BYTES,
    MAX_HEARTBEAT_TTL_SECONDS,
    MAX_PRIORITY,
    MAX_TIME_LIMIT_SECONDS,
    MAX_WORKERS,
    SPEC_MAX_BYTES,
    Arguments,
    EnvName,
    EnvValue,
)
from workflows.domain.constraints import GpuRequest, Network, NodeSelection, Topology
from workflows.domain.group_parts import (
    ArraySpec,
    Capabilities,
    Dependency,
    DriveSpec,
    ExternalAccess,
    Frozen,
    Name,
    PerGpu,
    PullPolicy,
    Readiness,
    SecretSpec,
)

RestartPolicy = Literal["OnFailure", "Always", "Never"]

MAX_EXTERNAL_ACCESS = 16  # ports one worker exposes on its machine


class GroupSpec(Frozen):
    """A worker group: `replicas` identical workers (tasks) of one kind."""

    name: Name
    replicas: int = Field(1, ge=1, le=MAX_WORKERS, description="How many workers of this group.")
    command: Arguments = Field(description="The program and its arguments.")
    image: str | None = Field(
        None,
        min_length=1,
        max_length=IMAGE_MAX_CHARS,
        description="Container image (docker runtime); ignored by the process runtime.",
    )
    env: dict[EnvName, EnvValue] = Field(
        default_factory=dict, max_length=ENV_MAX_VARIABLES, description="Environment variables of each worker."
    )
    cpu: float = Field(1.0, ge=0, le=4096, description="CPU cores per worker.")
    memory_bytes: int = Field(0, ge=0, le=MAX_BYTES, description="Memory per worker, in bytes.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs per worker.")
    total_gpus: int | None = Field(
        None,
        ge=1,
        le=65536,
        description="GPUs of the whole group, split by the scheduler into workers of equal power-of-2 size, one "
        "per machine (instead of replicas and gpus).",
    )
    machines: int | None = Field(
        None, ge=1, le=MAX_WORKERS, description="With total_gpus: split across exactly this many."
    )
    restart_policy: RestartPolicy = Field("OnFailure", description="When an ended worker starts again.")

    time_limit_seconds: float | None = Field(
        None,
        gt=0,
        le=MAX_TIME_LIMIT_SECONDS,
        description="Stop the worker after this long Running; it then fails for good.",
    )
    heartbeat_ttl_seconds: float | None = Field(
        None,
        gt=0,
        le=MAX_HEARTBEAT_TTL_SECONDS,
        description="Stale past the grace, Down after this long unheard (default 60).",
    )
    pull_policy: PullPolicy = Field("IfNotPresent", description="Always, IfNotPresent or None (never pull).")
    registry_secret: Name | None = Field(
        None, description="Secret with keys username and password, to pull the image from its registry."
    )
    drives: list[DriveSpec] = Field(default_factory=list, max_length=64, description="Drives mounted in each worker.")
    secrets: list[SecretSpec] = Field(default_factory=list, max_length=256, description="Secrets given to each worker.")

    gpu_requests: list[GpuRequest] | None = Field(
        None, max_length=16, description="GPUs its workers accept (any of these); default: any GPU."
    )
    healthy_only: bool = Field(False, description="Only GPUs with no fault and none at risk.")
    node_selection: NodeSelection | None = Field(
        None, description="Machines its workers may use, by names, labels and pools (with the run's own)."
    )

    depends_on: list[Dependency] = Field(
        default_factory=list, max_length=64, description="Groups that must run (or be healthy) before this one."
    )
    array: ArraySpec | None = Field(None, description="An array of independent workers, max_parallel at once.")
    readiness: Readiness | None = Field(None, description="When a running worker is healthy (serving).")

    per_gpu: PerGpu | None = Field(
        None,
        description="Host memory that scales with each worker's GPUs: placed on and limited to gpus x "
        "per_gpu.memory_bytes (instead of memory_bytes).",
    )
    external_access: list[ExternalAccess] = Field(
        default_factory=list,
        max_length=MAX_EXTERNAL_ACCESS,
        description="Ports each worker listens on, exposed on its machine at a port the machine assigns.",
    )
    identity: bool = Field(
        False,
        description="Give each worker attempt an X.509 certificate naming its workspace, run, worker and attempt "
        "(spiffe://astraeus/ns/<ns>/run/<run>/worker/<worker>/attempt/<n>), issued by the cluster CA, renewed while "
        "it runs, as files named by ASTRAEUS_IDENTITY_CERT, ASTRAEUS_IDENTITY_KEY and ASTRAEUS_IDENTITY_BUNDLE.",
    )
    network: Network | None = Field(
        None, description="What its workers need of the machine's network: RDMA, InfiniBand at a speed, a fabric."
    )

    capabilities: Capabilities | None = Field(
        None, description="What its workers require of their machine: outbound policy, sandbox, gateways."
    )

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, command: list[str]) -> list[str]:
        if not command[0].strip():
            raise ValueError("the program (first item) is empty")
        return command

    @field_validator("env")
    @classmethod
    def _env_fits(cls, env: dict[str, str]) -> dict[str, str]:
        size = sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())  # NAME=VALUE and its NUL
        if size > ENV_MAX_BYTES:
            raise ValueError(f"{size} bytes in all (names and values), at most {ENV_MAX_BYTES}")
        return env

    @model_validator(mode="after")
    def _planned_or_counted(self) -> GroupSpec:
        if self.total_gpus is None:
            if self.machines is not None:
                raise ValueError("machines: only with total_gpus")
            return self
        # Judged by value, not by which fields were written: a spec dumped and read again must stay valid.
        given = [
            name for name, unset in (("replicas", 1), ("gpus", 0), ("array", None)) if getattr(self, name) != unset
        ]
        if given:
            raise ValueError(f"total_gpus: the scheduler sets the workers and their GPUs; leave out {', '.join(given)}")
        return self

    @model_validator(mode="after")
    def _memory_per_worker_or_per_gpu(self) -> GroupSpec:
        """memory_bytes and per_gpu.memory_bytes say one thing two ways (Slurm refuses --mem with --mem-per-gpu);
        per GPU needs GPUs. Judged by value, as above."""
        if self.per_gpu is None:
            return self
        if self.memory_bytes:
            raise ValueError("per_gpu.memory_bytes: set memory_bytes or per_gpu.memory_bytes, not both")
        if not self.gpus and not self.planned:
            raise ValueError(
                "per_gpu.memory_bytes: the group asks for no GPUs (set gpus or total_gpus, or memory_bytes)"
            )
        most = self.total_gpus or self.gpus  # a planned worker has at most every GPU of its group
        if most * self.per_gpu.memory_bytes > MAX_BYTES:
            raise ValueError(
                f"per_gpu.memory_bytes: {most} GPUs x {self.per_gpu.memory_bytes} bytes is more than {MAX_BYTES} bytes"
            )
        return self

    @property
    def worker_memory_bytes(self) -> int:
        """Host memory of each worker: memory_bytes, or its GPUs x per_gpu.memory_bytes."""
        return self.memory_bytes if self.per_gpu is None else self.gpus * self.per_gpu.memory_bytes

    @property
    def planned(self) -> bool:
        """Its workers are planned by the scheduler from total_gpus."""
        return self.total_gpus is not None

    @property
    def on_mesh(self) -> bool:
        """Its workers join the node network (network.mesh)."""
        return self.network is not None and self.network.mesh

    @model_validator(mode="after")
    def _mounts_and_variables_unique(self) -> GroupSpec:
        """Two mounts at one path, or a secret's variable that `env` also sets, would hide one another."""
        paths = [d.mount_path for d in self.drives] + [s.path for s in self.secrets if s.path]
        twice = sorted({p for p in paths if paths.count(p) > 1})
        if twice:
            raise ValueError(f"drives and secrets: {', '.join(twice)} mounted twice")
        names = [d.name for d in self.drives]
        if len(set(names)) != len(names):
            raise ValueError(
                f"drives: duplicate drive name {', '.join(sorted({n for n in names if names.count(n) > 1}))}"
            )
        for field, values in (("name", [a.name for a in self.external_access]),
                              ("port", [str(a.port) for a in self.external_access])):  # fmt: skip
            twice = sorted({v for v in values if values.count(v) > 1})
            if twice:
                raise ValueError(f"external_access: {field} {', '.join(twice)} given twice")
        variables = [s.env for s in self.secrets if s.env]
        clash = sorted({v for v in variables if variables.count(v) > 1 or v in self.env})
        if clash:
            raise ValueError(f"secrets: {', '.join(clash)} set twice (by env or another secret)")
        return self


class JobSpec(Frozen):
    """One run: a name, a namespace (workspace), a priority and its worker groups."""

    name: Name
    namespace: Name = "default"
    priority: int = Field(0, ge=0, le=MAX_PRIORITY, description="Higher runs first.")
    lifetime: Literal["Batch", "Service"] = Field(
        "Batch", description="Batch runs end; a Service's workers serve until stopped ('r of n workers serving')."
    )
    groups: list[GroupSpec] = Field(min_length=1, max_length=64)

    gang: bool = Field(False, description="Place every worker together or none, and start them together.")
    leader: str | None = Field(
        None,
        max_length=LEADER_MAX_CHARS,
        description="A gang's leader worker (default: the first worker); its failure restarts the gang.",
    )
    min_available: int | None = Field(
        None,
        ge=1,
        le=MAX_WORKERS,
        description="A gang may start once this many of its first workers are placed together.",
    )
    complete_with: Name | None = Field(
        None, description="The run completes when this group completes; the other groups serve it."
    )
    on_failure: Literal["RestartTask", "RestartJob"] | None = Field(
        None,
        description="Who restarts when a worker fails: only it, or every worker of the run "
        "(default RestartJob for a gang, else RestartTask).",
    )
    topology: Topology | None = Field(
        None, description="Where its workers sit: one machine, one rack, at most n machines, patience for a fabric."
    )
    node_selection: NodeSelection | None = Field(
        None, description="Machines every worker may use, by names, labels and pools."
    )

    @model_validator(mode="after")
    def _within_bounds(self) -> JobSpec:
        """A run's workers and its whole spec stay within what one run's workflow carries."""
        workers = sum(g.machines or 1 if g.planned else g.replicas for g in self.groups)
        if workers > MAX_WORKERS:
            raise ValueError(f"groups: {workers} workers in all, at most {MAX_WORKERS} in one run")
        for i, group in enumerate(self.groups):
            if self.node_selection is None or group.node_selection is None:
                continue
            try:  # what its workers ask of the scheduler: the run's selection with the group's
                self.node_selection.merged(group.node_selection)
            except ValidationError as error:
                raise ValueError(
                    f"groups.{i}.node_selection: with the run's node_selection, {format_errors(error)}"
                ) from None
        size = len(self.model_dump_json())
        if size > SPEC_MAX_BYTES:
            parts = {f"groups.{i}": len(g.model_dump_json()) for i, g in enumerate(self.groups)}
            if self.node_selection is not None:
                parts["node_selection"] = len(self.node_selection.model_dump_json())
            largest = max(parts, key=lambda part: parts[part])
            raise ValueError(
                f"{largest}: the run spec is {size} bytes as JSON, at most {SPEC_MAX_BYTES}; "
                f"this is its largest part ({parts[largest]} bytes)"
            )
        return self

    @model_validator(mode="after")
    def _unique_groups(self) -> JobSpec:
        names = [g.name for g in self.groups]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"groups: duplicate group name {', '.join(duplicates)}")
        return self

    @model_validator(mode="after")
    def _groups_named_exist(self) -> JobSpec:
        groups = {g.name: g for g in self.groups}
        if self.complete_with is not None and self.complete_with not in groups:
            raise ValueError(f"complete_with: no group named {self.complete_with}")
        if self.complete_with is not None and self.lifetime == "Service":
            raise ValueError("complete_with: a Service run does not complete; use lifetime Batch")
        for group in self.groups:
            for dependency in group.depends_on:
                target = groups.get(dependency.group)
                if target is None:
                    raise ValueError(f"groups.{group.name}.depends_on: no group named {dependency.group}")
                if target is group:
                    raise ValueError(f"groups.{group.name}.depends_on: a group cannot wait for itself")
                if dependency.condition == "healthy" and target.readiness is None:
                    raise ValueError(
                        f"groups.{group.name}.depends_on: group {target.name} has no readiness check, so it is "
                        "never healthy (wait for running, or give it a readiness check)"
                    )
        cycle = _dependency_cycle(self.groups)
        if cycle:
            raise ValueError(f"depends_on: the groups wait for each other in a cycle: {' -> '.join(cycle)}")
        return self

    @model_validator(mode="after")
    def _gang_mesh_all_or_none(self) -> JobSpec:
        """A gang's members meet at MASTER_ADDR: on the node network the address the leader's machine holds for it
        there, else its machine's own. Members on the node network reach no machine's own network, and members
        sharing their machine's network reach no node network beyond their machine: all groups ask it, or none."""
        meshed = [g.on_mesh for g in self.groups]
        if self.gang and any(meshed) and not all(meshed):
            index = meshed.index(False)
            raise ValueError(
                f"groups.{index}.network.mesh: a gang's groups ask for the node network all or none (its workers "
                f"meet at MASTER_ADDR, the leader's address there or on its machine's own network); group "
                f"{self.groups[index].name} does not ask it, group {self.groups[meshed.index(True)].name} does"
            )
        return self

    @model_validator(mode="after")
    def _gang_fields(self) -> JobSpec:
        workers = [f"{g.name}-{i}" for g in self.groups for i in range(g.replicas)]
        if not self.gang:
            for field in ("leader", "min_available"):
                if getattr(self, field) is not None:
                    raise ValueError(f"{field}: only a gang has one (set gang: true)")
            return self
        if self.leader is not None and self.leader not in workers:
            raise ValueError(f"leader: no worker named {self.leader} (workers are named <group>-<index>)")
        if self.min_available is not None and self.min_available > len(workers):
            raise ValueError(f"min_available: {self.min_available} is more than the run's {len(workers)} workers")
        for group in self.groups:
            if group.depends_on:
                raise ValueError(f"groups.{group.name}.depends_on: a gang starts every worker together")
            if group.array is not None:
                raise ValueError(f"groups.{group.name}.array: a gang starts every worker together")
        return self

    @property
    def failure_policy(self) -> Literal["RestartTask", "RestartJob"]:
        """on_failure, or its default: RestartJob for a gang, RestartTask otherwise."""
        if self.on_failure is not None:
            return self.on_failure
        return "RestartJob" if self.gang else "RestartTask"

    @property
    def leader_id(self) -> str:
        """The worker whose failure restarts a gang under RestartTask: named, or the first worker."""
        return self.leader or f"{self.groups[0].name}-0"

    @property
    def job_id(self) -> str:
        return job_id(self.namespace, self.name)


def _dependency_cycle(groups: list[GroupSpec]) -> list[str]:
    """A cycle of depends_on, as group names from one back to itself; empty when there is none."""
    waits = {g.name: [d.group for d in g.depends_on] for g in groups}

    def visit(name: str, path: list[str]) -> list[str]:
        if name in path:
            return [*path[path.index(name) :], name]
        for target in waits.get(name, []):
            found = visit(target, [*path, name])
            if found:
                return found
        return []

    for group in groups:
        found = visit(group.name, [])
        if found:
            return found
    return []


def job_id(namespace: str, name: str) -> str:
    """The run's workflow id."""
    return f"job/{namespace}/{name}"


def format_errors(error: ValidationError) -> str:
    """One line per problem, each naming the field: `groups.0.gpus: Input should be ...`."""
    lines = []
    for item in error.errors():
        parts = [str(part) for part in item["loc"]]
        if parts[-1:] == ["[key]"]:  # a mapping's key: (..., "env", "<key>", "[key]")
            *parts, key, _ = parts
            parts[-1] += f" key {key!r}"
        where = ".".join(parts)
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field"
        lines.append(f"{where}: {message}" if where else message)
    return "\n".join(lines)


def parse_spec(data: Any) -> JobSpec:
    """Validate a decoded spec; raises ValueError with one line per problem."""
    if not isinstance(data, dict):
        raise ValueError("spec: expected a mapping of fields")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as error:
        raise ValueError(format_errors(error)) from None
