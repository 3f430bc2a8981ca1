"""The parts of a worker group's spec: its drives and secrets, its network (ports exposed, outbound policy), the
capabilities it needs, its readiness check, what it waits for, and its array and per-GPU sizing; with the names and
the frozen base that every model of the spec shares (`spec.py` puts them together)."""

from __future__ import annotations

import ipaddress
import posixpath
import re
from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workflows.domain.bounds import (
    MAX_BYTES,
    MAX_WORKERS,
    Arguments,
    EnvName,
    Label,
    PathText,
)
from workflows.domain.constraints import Capability

NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="Lower-case letters, digits and dashes.")]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


PullPolicy = Literal["Always", "IfNotPresent", "None"]
KEY_PATTERN = r"^[A-Za-z0-9_][-._A-Za-z0-9]*$"
ENV_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
VOLUME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


def _absolute_path(path: str) -> str:
    """An absolute, normal path: no `..`, no `.`, no doubled or trailing slash."""
    if not path.startswith("/"):
        raise ValueError(f"{path!r} is not an absolute path")
    if "\0" in path or posixpath.normpath(path) != path or "/../" in f"{path}/":
        raise ValueError(f"{path!r} is not a normal path (write it as {posixpath.normpath(path)!r})")
    if path == "/":
        raise ValueError("'/' cannot be mounted over")
    return path


class DriveSpec(Frozen):
    """A drive mounted into each worker: a path of the machine (`host_path`), an engine's named `volume`, or a drive
    of the cluster's catalogue (`drive`, made with `astraeus drive create`), which its machine copies to its data
    location before the worker starts."""

    name: Name = Field(description="The drive's name, as reasons show it.")
    host_path: PathText | None = Field(
        None, description="A directory of the machine; the worker waits until it exists."
    )
    volume: str | None = Field(
        None,
        pattern=VOLUME_PATTERN,
        max_length=255,
        description="A named volume of the engine (created empty on first use).",
    )
    drive: Name | None = Field(
        None,
        description="A drive of the cluster's catalogue (astraeus drive ls): its machine's copy, filled before the "
        "worker starts and kept for the next; always read-only.",
    )
    mount_path: PathText = Field(description="Where the worker sees it.")
    read_only: bool | None = Field(None, description="Mount it read-only (default: false; a placed drive: true).")

    @field_validator("host_path", "mount_path")
    @classmethod
    def _paths_are_absolute(cls, path: str | None) -> str | None:
        return None if path is None else _absolute_path(path)

    @model_validator(mode="after")
    def _one_source(self) -> DriveSpec:
        if sum(source is not None for source in (self.host_path, self.volume, self.drive)) != 1:
            raise ValueError("set exactly one of host_path, volume and drive")
        if self.drive is not None and self.read_only is False:
            raise ValueError("read_only: a placed drive's copy is shared by the machine's workers; it is read-only")
        return self

    @property
    def mounted_read_only(self) -> bool:
        return self.drive is not None or bool(self.read_only)


class SecretSpec(Frozen):
    """One key of a secret synced to the machine, given to each worker as an environment variable or a file."""

    name: Name = Field(description="The secret, on the machine under <agent data dir>/secrets/<name>/.")
    key: str = Field(pattern=KEY_PATTERN, max_length=253, description="The key: the file <name>/<key> holds its value.")
    env: EnvName | None = Field(None, pattern=ENV_PATTERN, description="Given as this environment variable.")
    path: PathText | None = Field(None, description="Given as a read-only file at this path (docker runtime).")

    @field_validator("path")
    @classmethod
    def _path_is_absolute(cls, path: str | None) -> str | None:
        return None if path is None else _absolute_path(path)

    @model_validator(mode="after")
    def _one_target(self) -> SecretSpec:
        if (self.env is None) == (self.path is None):
            raise ValueError("set exactly one of env and path")
        return self


class ExternalAccess(Frozen):
    """A port the worker listens on, exposed on its machine: the machine assigns it a port of its own (from its
    agent's --external-ports range), and people reach the worker at <machine address>:<that port>."""

    name: Name = Field(description="Names it: the worker finds its ports in ASTRAEUS_PORT_<NAME> and "
                       "ASTRAEUS_EXTERNAL_PORT_<NAME> (upper case, dashes as underscores).")  # fmt: skip
    port: int = Field(ge=1, le=65535, description="The port the worker listens on in its container.")

    @property
    def variable(self) -> str:
        """The name's part of its environment variables: `web-ui` -> `WEB_UI`."""
        return self.name.upper().replace("-", "_")


HOST_PATTERN = (
    r"^(?=.{1,253}$)[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?(\.[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?)*$"
)


def _host_or_cidr(entry: str) -> str:
    """An address or network (10.0.0.0/8, 192.0.2.7, 2001:db8::/32) or a host name (pypi.org)."""
    try:
        return str(ipaddress.ip_network(entry, strict=False))
    except ValueError:
        pass
    if re.match(HOST_PATTERN, entry) is None or entry.replace(".", "").isdigit():
        raise ValueError(f"{entry!r} is neither an address, a network (10.0.0.0/8) nor a host name")
    return entry.lower()


class OutboundPolicy(Frozen):
    """Egress allowed only to these hosts and networks; the machine refuses every other connection the worker opens."""

    allow: list[Label] = Field(
        min_length=1, max_length=256, description="Addresses, networks (10.0.0.0/8) and host names (pypi.org)."
    )

    @field_validator("allow")
    @classmethod
    def _entries(cls, allow: list[str]) -> list[str]:
        return [_host_or_cidr(entry) for entry in allow]


class Capabilities(Frozen):
    """What its workers require of their machine besides room: each is checked on the machine, or set up by it."""

    outbound_policy: OutboundPolicy | None = Field(
        None, description="Egress only to the hosts and networks listed; the machine must enforce it."
    )
    sandbox: bool = Field(False, description="Run each worker in gVisor (runsc), a kernel in user space.")
    tool_gateway: bool = Field(False, description="The machine's tool gateway, given as ASTRAEUS_TOOL_GATEWAY.")
    model_server: bool = Field(False, description="The machine's model server, given as ASTRAEUS_MODEL_SERVER.")
    interactive_token: bool = Field(
        False,
        description="Its machine hosts sessions in each attempt: a person holding a token issued for it runs commands "
        "in the running worker (astraeus interactive-token, astraeus attach).",
    )

    def checked(self) -> tuple[Capability, ...]:
        """What the scheduler checks on each machine, in the spec's order."""
        wanted = {"outbound_policy": self.outbound_policy is not None, "sandbox": self.sandbox}
        wanted["tool_gateway"] = self.tool_gateway
        return tuple(name for name in get_args(Capability) if wanted[name])


class HttpGet(Frozen):
    """A readiness check that GETs http://<the worker's address>:<port><path>; a 2xx or 3xx answer passes."""

    port: int = Field(ge=1, le=65535)
    path: str = Field("/", pattern=r"^/[^\s]*$", max_length=2048)


class Readiness(Frozen):
    """How a worker of the group shows it is healthy (serving): a command that exits 0, or an HTTP GET."""

    command: Arguments | None = Field(None, description="Run in the worker's environment.")
    http_get: HttpGet | None = None
    period_seconds: float = Field(5, gt=0, le=3600, description="How often the machine checks.")
    timeout_seconds: float = Field(2, gt=0, le=600, description="A check that takes longer fails.")

    @model_validator(mode="after")
    def _one_check(self) -> Readiness:
        if (self.command is None) == (self.http_get is None):
            raise ValueError("set exactly one of command and http_get")
        return self


class Dependency(Frozen):
    """Start the group's workers only once every worker of `group` runs (or, `healthy`, passes its readiness)."""

    group: Name
    condition: Literal["running", "healthy"] = "running"


class ArraySpec(Frozen):
    """The group is an array of `replicas` independent workers, at most `max_parallel` placed at once."""

    max_parallel: int = Field(ge=1, le=MAX_WORKERS)


class PerGpu(Frozen):
    """What a worker gets for each of its GPUs (as Slurm's --mem-per-gpu): its host memory is gpus x memory_bytes."""

    memory_bytes: int = Field(gt=0, le=MAX_BYTES, description="Host memory per GPU of the worker, in bytes.")
