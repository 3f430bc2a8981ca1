"""The port every runtime implements, and the errors it raises (mapped once, at the adapter)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from workflows.domain.reasons import Reason


@dataclass(frozen=True)
class TaskKey:
    """Names one attempt of one worker on a machine; a retried start finds its own container by it."""

    namespace: str
    job: str
    task: str
    attempt: int

    @property
    def slug(self) -> str:
        return f"{self.namespace}.{self.job}.{self.task}.{self.attempt}"


@dataclass(frozen=True)
class Launch:
    """What to run: the command, its environment, the GPUs it was given and its limits."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    image: str | None = None
    gpu_indices: list[int] = field(default_factory=list)
    cpu: float = 0
    memory_bytes: int = 0


@dataclass(frozen=True)
class Observed:
    """What the runtime sees of an attempt now."""

    running: bool
    exit_code: int | None = None
    oom: bool = False
    not_found: bool = False


class RuntimeFailure(Exception):
    """A start the runtime refused; `reason` is the spec's sentence (e.g. "Container start failed: ...")."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.text)
        self.reason = reason


class Runtime(Protocol):
    """Starts, watches and stops one attempt of a worker. Every method is idempotent."""

    name: str

    def start(self, key: TaskKey, launch: Launch) -> None:
        """Start the attempt unless it already exists (running or ended). Raises RuntimeFailure."""

    def observe(self, key: TaskKey) -> Observed:
        """Running, exited with a code, or not found on this machine."""

    def stop(self, key: TaskKey, grace_seconds: float) -> None:
        """Send the stop signal, wait up to the grace period, then kill. Returns once it has ended."""

    def log_tail(self, key: TaskKey, lines: int, max_bytes: int) -> str:
        """The last `lines` lines of its output, at most `max_bytes` bytes."""

    def gpus_in_use(self) -> dict[str, list[int]]:
        """GPU indices held by attempts that still run, by attempt slug."""

    def attempts(self) -> list[TaskKey]:
        """Every attempt this machine knows, running or ended: what an agent that restarts finds."""

    def delete(self, key: TaskKey) -> None:
        """Remove an ended attempt and its logs."""
