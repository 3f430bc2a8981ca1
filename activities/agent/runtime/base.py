"""The port every runtime implements, and the errors it raises (mapped once, at the adapter)."""

from __future__ import annotations

import select
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from workflows.domain.group_parts import PullPolicy, Readiness
from workflows.domain.machine.attempts import PortMapping
from workflows.domain.reasons import Reason
from workflows.domain.refs import TaskRef


@dataclass(frozen=True)
class Mount:
    """A host path (`bind`) or an engine's named volume (`volume`) at `target` inside the container."""

    target: str
    source: str
    kind: Literal["bind", "volume"] = "bind"
    read_only: bool = False


@dataclass(frozen=True)
class RegistryAuth:
    """Credentials for pulling the image, read from a registry secret on the machine."""

    username: str
    password: str = field(repr=False)


def port_environment(ports: list[PortMapping], mapped: bool) -> dict[str, str]:
    """What a worker is told of its external access: ASTRAEUS_EXTERNAL_PORT_<NAME>, the machine's port people
    use, and ASTRAEUS_PORT_<NAME>, where it listens: its own port when the runtime maps the machine's port to it
    (a container on its own network), else the machine's port itself (a process, or the host's network)."""
    env: dict[str, str] = {}
    for p in ports:
        env[f"ASTRAEUS_EXTERNAL_PORT_{p.variable}"] = str(p.host_port)
        env[f"ASTRAEUS_PORT_{p.variable}"] = str(p.port if mapped else p.host_port)
    return env


@dataclass(frozen=True)
class Launch:
    """What to run: the command, its environment, the GPUs it was given, its limits, image and mounts."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    image: str | None = None
    gpu_indices: list[int] = field(default_factory=list)
    cpu: float = 0
    memory_bytes: int = 0
    pull_policy: PullPolicy = "IfNotPresent"
    registry_auth: RegistryAuth | None = field(default=None, repr=False)
    mounts: list[Mount] = field(default_factory=list)
    host_network: bool = False  # share the machine's network (a gang member: reachable at MASTER_ADDR:MASTER_PORT)
    ports: list[PortMapping] = field(default_factory=list)  # its external access, with the machine's ports
    sandbox_runtime: str | None = None  # the engine's runtime that sandboxes it (gVisor's runsc); None: none
    egress: tuple[str, ...] | None = None  # its outbound policy: the only networks it may reach; None: any
    network: str | None = None  # the machine's node network it joins (network.mesh); None: the runtime's default
    network_alias: str | None = None  # its name there, for the other workers on that network
    network_ip: str | None = None  # its address there, held for it at a gang's barrier (else the engine chooses)


# Told what a start is doing while it takes time (R.Pulling before an image pull); it must not raise.
OnProgress = Callable[[Reason], None]


def ignore_progress(reason: Reason) -> None:
    """The default OnProgress: nobody listens."""


@dataclass(frozen=True)
class Held:
    """A record of an attempt its runtime could not write yet (a full disk, say), kept in memory until it can: the
    attempt reads running meanwhile, so that its run waits for its exit rather than counting it lost."""

    record: str  # "exit" or "oom" (its worker ended), "pid" (its worker runs)
    directory: str  # where it is to be written
    filesystem: str  # the mount point of that directory's filesystem
    error: str  # why it cannot be: "No space left on device"


@dataclass(frozen=True)
class Observed:
    """What the runtime sees of an attempt now."""

    running: bool
    exit_code: int | None = None
    oom: bool = False
    not_found: bool = False
    ended_at: float | None = field(default=None, compare=False)  # when it exited (epoch seconds), if known
    held: Held | None = None  # running, but a record of it cannot be written yet


@dataclass(frozen=True)
class Executed:
    """What a command run in an attempt gave back (`Runtime.exec`). A command that ran past its timeout was killed:
    its code is 124, as timeout(1) says, and its stderr ends saying so."""

    exit_code: int
    stdout: bytes
    stderr: bytes


EXEC_TIMED_OUT = 124


def ran_too_long(timeout_seconds: float) -> bytes:
    return f"astraeus: the command ran past its timeout of {timeout_seconds:g} s and was stopped\n".encode()


class ExecRefused(Exception):
    """A command the runtime cannot run in the attempt: it does not run, or the engine refused the exec."""


class NetworkNotUp(Exception):
    """The runtime could not make the machine's node network; the message is the engine's why."""


class RuntimeFailure(Exception):
    """A start the runtime refused; `reason` is the spec's sentence (e.g. "Container start failed: ...")."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.text)
        self.reason = reason


class RuntimeUnavailable(Exception):
    """The runtime itself cannot be reached (the engine is down): nothing is known about the attempt."""


class Runtime(Protocol):
    """Starts, watches and stops one attempt of a worker. Every method is idempotent."""

    name: str
    # Whether `ensure_image` may pull an image (and so take long): the agent calls it on a thread. Without images it
    # only checks the launch, and is called at once.
    pulls_images: bool

    def start(self, key: TaskRef, launch: Launch, on_progress: OnProgress = ignore_progress) -> None:
        """Start the attempt unless it already exists (running or ended); never start one twice.
        Reports R.Pulling through `on_progress` before pulling an image. Raises RuntimeFailure."""

    def ensure_image(self, launch: Launch, on_progress: OnProgress = ignore_progress) -> None:
        """Make the launch's image present under its pull policy, starting nothing (a gang member at the barrier).
        Reports R.Pulling through `on_progress` before pulling. Raises RuntimeFailure."""

    def observe(self, key: TaskRef) -> Observed:
        """Running, exited with a code, or not found on this machine."""

    def ended_fd(self, key: TaskRef) -> int | None:
        """A new file descriptor that becomes readable once the attempt has ended, for the caller to wait on and
        close; None when this runtime cannot tell (the caller polls `observe`)."""

    def probe(self, key: TaskRef, readiness: Readiness) -> tuple[bool, str]:
        """Run the readiness check once against the running attempt, within its timeout: whether it passed, and
        a short detail ("exited with code 1", "HTTP 503", "connection refused", "timed out after 2s")."""

    def stop(self, key: TaskRef, grace_seconds: float) -> None:
        """Send the stop signal, wait up to the grace period, then kill. Returns once it has ended."""

    def log_tail(self, key: TaskRef, lines: int, max_bytes: int) -> str:
        """The last `lines` lines of its output, at most `max_bytes` bytes."""

    def exec(self, key: TaskRef, argv: list[str], stdin: bytes, timeout_seconds: float) -> Executed:
        """Run `argv` inside the running attempt (as it runs: its environment, its directory, its network), with
        `stdin` as its input, and wait for it up to its timeout. Raises ExecRefused when it cannot be run there."""

    def gpus_in_use(self) -> dict[str, list[int]]:
        """GPU indices held by attempts that still run, by attempt slug."""

    def ports_in_use(self) -> dict[str, dict[str, int]]:
        """The machine's ports held by attempts that still run for their external access, by attempt slug: name
        -> port. Kept with the attempt (its files, its container), so an agent that restarts finds them."""

    def attempts(self) -> list[TaskRef]:
        """Every attempt this machine knows, running or ended: what an agent that restarts finds."""

    def running(self) -> list[TaskRef]:
        """The attempts that run now: what the agent checks against their runs' workflows (orphans)."""

    def delete(self, key: TaskRef) -> None:
        """Remove an ended attempt and its logs."""


def forget_attempts(root: Path, keep: Iterable[str]) -> None:
    """Remove the directory of every attempt under `root` but those in `keep` (slugs): an ended attempt's files
    (its prepared files, its identity, its interactive sessions) end with it."""
    if not root.is_dir():
        return
    kept = set(keep)
    for directory in root.iterdir():
        if directory.name not in kept:
            shutil.rmtree(directory, ignore_errors=True)


def readable(fd: int, seconds: float) -> bool:
    """Whether `fd` is readable (a closed pipe, an ended process's pidfd) within `seconds`. By poll, not select:
    an agent with hundreds of workers holds descriptors past select's 1,024."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(seconds * 1000))
