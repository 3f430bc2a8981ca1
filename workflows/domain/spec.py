"""The run spec a user submits (the API calls it a job spec), with the spec's field names.

Unknown fields are errors, and so are fields the spec names that Astraeus does not honour yet: a field that is
accepted is honoured.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="Lower-case letters, digits and dashes.")]

RestartPolicy = Literal["OnFailure", "Always", "Never"]

# Fields of the spec that a later capability builds; until then a spec that sets one is refused by name.
NOT_BUILT_GROUP_FIELDS = (
    "time_limit_seconds",
    "heartbeat_ttl_seconds",
    "per_gpu",
    "gpu_requests",
    "healthy_only",
    "depends_on",
    "array",
    "node_selection",
    "readiness",
    "drives",
    "secrets",
    "pull_policy",
)
NOT_BUILT_JOB_FIELDS = ("on_failure", "min_available", "complete_with", "gang", "topology", "node_selection")

NotBuilt = Annotated[SkipJsonSchema[Any], Field(exclude=True, repr=False)]


def _refuse(value: Any, info: Any) -> Any:
    if value is not None:
        raise ValueError(f"{info.field_name} is not built yet; Astraeus refuses it rather than ignore it")
    return value


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GroupSpec(_Frozen):
    """A worker group: `replicas` identical workers (tasks) of one kind."""

    name: Name
    replicas: int = Field(1, ge=1, le=1000, description="How many workers of this group.")
    command: list[str] = Field(min_length=1, description="The program and its arguments.")
    image: str | None = Field(None, description="Container image (docker runtime); ignored by the process runtime.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment variables of each worker.")
    cpu: float = Field(1.0, ge=0, le=4096, description="CPU cores per worker.")
    memory_bytes: int = Field(0, ge=0, description="Memory per worker, in bytes.")
    gpus: int = Field(0, ge=0, le=64, description="GPUs per worker.")
    restart_policy: RestartPolicy = Field("OnFailure", description="When an ended worker starts again.")

    time_limit_seconds: NotBuilt = None
    heartbeat_ttl_seconds: NotBuilt = None
    per_gpu: NotBuilt = None
    gpu_requests: NotBuilt = None
    healthy_only: NotBuilt = None
    depends_on: NotBuilt = None
    array: NotBuilt = None
    node_selection: NotBuilt = None
    readiness: NotBuilt = None
    drives: NotBuilt = None
    secrets: NotBuilt = None
    pull_policy: NotBuilt = None

    _refuse_not_built = field_validator(*NOT_BUILT_GROUP_FIELDS)(_refuse)

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, command: list[str]) -> list[str]:
        if not command[0].strip():
            raise ValueError("the program (first item) is empty")
        return command


class JobSpec(_Frozen):
    """One run: a name, a namespace (workspace), a priority and its worker groups."""

    name: Name
    namespace: Name = "default"
    priority: int = Field(0, ge=0, le=1_000_000, description="Higher runs first.")
    lifetime: Literal["Batch"] = Field("Batch", description="Batch runs end; Service is not built yet.")
    groups: list[GroupSpec] = Field(min_length=1, max_length=64)

    on_failure: NotBuilt = None
    min_available: NotBuilt = None
    complete_with: NotBuilt = None
    gang: NotBuilt = None
    topology: NotBuilt = None
    node_selection: NotBuilt = None

    _refuse_not_built = field_validator(*NOT_BUILT_JOB_FIELDS)(_refuse)

    @model_validator(mode="after")
    def _unique_groups(self) -> JobSpec:
        names = [g.name for g in self.groups]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"groups: duplicate group name {', '.join(duplicates)}")
        return self

    @property
    def job_id(self) -> str:
        return job_id(self.namespace, self.name)


def job_id(namespace: str, name: str) -> str:
    """The run's workflow id."""
    return f"job/{namespace}/{name}"


def format_errors(error: ValidationError) -> str:
    """One line per problem, each naming the field: `groups.0.gpus: Input should be ...`."""
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"])
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
