"""Status and history of runs and workers: every change with its time, oldest first."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from workflows.domain.reasons import Reason
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec


class RunState(StrEnum):
    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


class TaskState(StrEnum):
    PENDING = "Pending"
    PREPARING = "Preparing"
    PULLING = "Pulling"
    READY_TO_START = "ReadyToStart"
    STARTING = "Starting"
    RUNNING = "Running"
    STALE = "Stale"
    STOPPING = "Stopping"
    COMPLETED = "Completed"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    DOWN = "Down"


RUN_TERMINAL = frozenset({RunState.COMPLETED, RunState.FAILED, RunState.CANCELLED})
# Ended: no container of this attempt runs; the worker is started again only by a restart.
TASK_ENDED = frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED, TaskState.DOWN})
# Placed on a machine, which may have a container of it.
TASK_ON_NODE = frozenset(
    {
        TaskState.PREPARING,
        TaskState.PULLING,
        TaskState.READY_TO_START,
        TaskState.STARTING,
        TaskState.RUNNING,
        TaskState.STALE,
        TaskState.STOPPING,
    }
)


class StatusEntry(BaseModel):
    """One change: the state, why, and when."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    state: str
    reason: str
    code: str
    at: datetime


class Status(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: str
    reason: str
    code: str
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class LastFailure(BaseModel):
    """The last failure of a worker: its exit code, reason and the end of its log."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    exit_code: int | None
    reason: str
    log_tail: str


class NodeReasons(BaseModel):
    """Why one machine does not take a waiting worker (`placement.nodes[]`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    reasons: list[str]


class Placement(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: list[NodeReasons] = Field(default_factory=list)


class TaskRecord(BaseModel):
    """One worker (task): where it is, its status and its history."""

    model_config = ConfigDict(extra="forbid")

    id: str
    group: str
    index: int
    attempt: int = 0
    node: str | None = None
    restarts: int = 0
    restart_at: datetime | None = None
    final: bool = False
    stopped: bool = False  # a person, the API or the run stopped it: never counted as a failure
    running_since: datetime | None = None
    status: Status
    history: list[StatusEntry] = Field(default_factory=list)
    last_failure: LastFailure | None = None
    waiting_on: list[NodeReasons] = Field(default_factory=list)  # every machine's reasons while it waits

    @property
    def state(self) -> TaskState:
        return TaskState(self.status.state)


class JobRecord(BaseModel):
    """The whole state of one run, as its workflow holds it (continue-as-new carries exactly this)."""

    model_config = ConfigDict(extra="forbid")

    spec: JobSpec
    settings: Settings
    status: Status
    history: list[StatusEntry] = Field(default_factory=list)
    tasks: list[TaskRecord] = Field(default_factory=list)
    cancel_requested: bool = False

    @property
    def id(self) -> str:
        return self.spec.job_id

    @property
    def state(self) -> RunState:
        return RunState(self.status.state)

    def task(self, task_id: str) -> TaskRecord:
        for task in self.tasks:
            if task.id == task_id:
                return task
        raise KeyError(f"run {self.spec.namespace}/{self.spec.name} has no worker {task_id}")


def record(status: Status, history: list[StatusEntry], state: str, reason: Reason, now: datetime) -> bool:
    """Set a status and append to its history, only if state or reason changed. Returns whether it did."""
    if status.state == state and status.reason == reason.text and history:
        return False
    status.state, status.reason, status.code = state, reason.text, reason.code
    history.append(StatusEntry(state=state, reason=reason.text, code=reason.code, at=now))
    return True
