"""Status and history of runs and workers: every change with its time, oldest first."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workflows.domain.reasons import NodeReasons, R, Reason
from workflows.domain.settings import Settings
from workflows.domain.spec import GroupSpec, JobSpec


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
# Set up, running or stopping on a machine, which may have a container of it. A worker placed there whose machine
# has not picked it up yet is still Pending, with its machine set (TaskRecord.on_node counts both).
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


# Why Astraeus stopped a worker, when that decides what follows: queued again, fails the run, or waits for a gang.
StopCause = Literal["preempted", "time_limit", "gang_restart", "barrier"]


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


class PlacementNode(BaseModel):
    """One machine's reasons as `describe` shows them (`placement.nodes[]`): the sentences people read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    reasons: list[str]


class Placement(BaseModel):
    """Why the first waiting worker waits, machine by machine (`describe`'s `placement`): each machine's reasons,
    and `counts`, how many machines say each reason (by code, most first), as Nomad's placement metrics count
    them: the "No machine fits" sentence gives only how many machines are ready."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: list[PlacementNode] = Field(default_factory=list)
    counts: dict[str, int] = Field(default_factory=dict)

    @classmethod
    def of(cls, nodes: list[NodeReasons]) -> Placement:
        counts = Counter(reason.code for node in nodes for reason in node.reasons)
        return cls(
            nodes=[PlacementNode(name=n.name, reasons=n.texts) for n in nodes],
            counts=dict(sorted(counts.items(), key=lambda item: (-item[1], item[0]))),
        )


class Attempt(BaseModel):
    """What is true of one attempt of a worker only: where it was placed, since when it runs, how it is. A new
    attempt is a new Attempt, so nothing of the one before leaks into it."""

    model_config = ConfigDict(extra="forbid")

    number: int = 0
    node: str | None = None
    address: str | None = None  # its machine's address, once placed
    running_since: datetime | None = None
    stale_since: datetime | None = None
    released: bool = False  # a gang member at the barrier that was told to start
    healthy: bool | None = None  # its readiness check: None until the machine first reports it
    external: dict[str, str] = Field(default_factory=dict)  # external_access: name -> "<address>:<port>" people use
    node_address: str | None = None  # network.mesh: its address on its machine's subnet, once started
    # Its machine was lost while it ran: a copy may run on there until its agent's fence, so it starts again no sooner.
    fenced_until: datetime | None = None


class StopIntent(BaseModel):
    """Why Astraeus stops (or stopped) the current attempt: "requested" by a person, the API or the run (never
    counted as a failure), or a cause that decides what follows its end (`StopCause`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cause: Literal["requested"] | StopCause

    @property
    def stopped(self) -> bool:
        """Stopped for good: on request, or past its time limit (the run then fails on it)."""
        return self.cause in ("requested", "time_limit")


class Final(BaseModel):
    """It ended, or ends once stopped, for good: never started again."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["final"] = "final"

    @model_validator(mode="before")
    @classmethod
    def _no_restart(cls, data: Any) -> Any:
        """Records written before kept a gang restart's back-off here when a worker stopping for that restart was
        stopped for good (`restart_at`): it never restarts, so the time is dropped rather than shown."""
        if isinstance(data, dict) and "restart_at" in data:
            return {key: value for key, value in data.items() if key != "restart_at"}
        return data


class RestartAt(BaseModel):
    """Restarted by its policy once its back-off is over (a Restart timer is armed)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["restart_at"] = "restart_at"
    at: datetime


class RequeueWithGang(BaseModel):
    """Queued again with the others (a gang restart, RestartJob, a barrier that timed out), with `reason`, not
    before `at` (the back-off of the worker whose failure restarted them all). Set on the worker whose failure
    restarted them and on each worker the restart stopped: what it does once this attempt ends follows from it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["requeue_with_gang"] = "requeue_with_gang"
    reason: Reason
    at: datetime | None = None


# What follows the end of the current attempt; None: its end decides (its restart policy).
After = Annotated[Final | RestartAt | RequeueWithGang, Field(discriminator="kind")]


class TaskRecord(BaseModel):
    """One worker (task): its status and history, its current attempt, why that attempt is stopped and what
    follows its end."""

    model_config = ConfigDict(extra="forbid")

    id: str
    group: str
    index: int
    restarts: int = 0
    gated: bool = False  # depends_on holds it back: not asked of the scheduler yet
    summarised: int = 0  # history entries folded into one summary entry
    status: Status
    history: list[StatusEntry] = Field(default_factory=list)
    last_failure: LastFailure | None = None
    waiting_on: list[NodeReasons] = Field(default_factory=list)  # every machine's reasons while it waits
    # The run that preempted it: set when the preemption reaches it, kept across the attempt it is queued again as,
    # until it is placed again; while it waits the run says "<cause>; waiting to run again".
    preempted_by: str | None = None
    # Its time limit, once the limit's timer fired for it (kept for good): ended for good, it fails the run.
    exceeded: str | None = None
    attempt: Attempt = Field(default_factory=Attempt)
    stop: StopIntent | None = None
    after: After | None = None

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        """A record written before the split held every field flat (a continue-as-new input of an older run)."""
        if isinstance(data, dict) and (isinstance(data.get("attempt"), int) or _FLAT.keys() & data.keys()):
            return unflatten(data)
        return data

    @property
    def state(self) -> TaskState:
        return TaskState(self.status.state)

    @property
    def node(self) -> str | None:
        """The machine of its current attempt, once placed."""
        return self.attempt.node

    @property
    def final(self) -> bool:
        """Ended, or ends once stopped, for good."""
        return isinstance(self.after, Final)

    @property
    def stopped(self) -> bool:
        """A person, the API or the run stopped it, or its time limit: never counted as a failure of its own."""
        return self.stop is not None and self.stop.stopped

    @property
    def restart_at(self) -> datetime | None:
        """When it is queued again (its back-off, or the one its gang waits out), as `describe` shows it."""
        match self.after:
            case RestartAt(at=at) | RequeueWithGang(at=at):
                return at
        return None

    @property
    def placed_pending(self) -> bool:
        """Placed on a machine that has not picked it up yet: Pending, its machine set (protocol 5)."""
        return self.state is TaskState.PENDING and self.node is not None

    @property
    def waiting(self) -> bool:
        """Pending and not placed: it waits for the scheduler."""
        return self.state is TaskState.PENDING and self.node is None

    @property
    def on_node(self) -> bool:
        """Its machine holds it: placed there (even not picked up yet), set up, running or stopping there."""
        return self.state in TASK_ON_NODE or self.placed_pending


# Fields of a record written before the split, and where each went: `attempt` was its number.
_FLAT = {
    "node": "attempt",
    "address": "attempt",
    "running_since": "attempt",
    "stale_since": "attempt",
    "released": "attempt",
    "healthy": "attempt",
    "stopped": "stop",
    "stop_cause": "stop",
    "final": "after",
    "restart_at": "after",
    "requeue": "after",
}


def unflatten(data: dict[str, Any]) -> dict[str, Any]:
    """A worker's record of the flat shape in the new one, meaning the same: its attempt's fields in `attempt`;
    stopped/stop_cause as `stop`; final/restart_at/requeue as `after`."""
    flat = dict(data)
    attempt: dict[str, Any] = {"number": flat.pop("attempt", 0)}
    attempt |= {key: flat.pop(key) for key, to in _FLAT.items() if to == "attempt" and key in flat}
    stopped, cause = flat.pop("stopped", False), flat.pop("stop_cause", None)
    final, restart_at, requeue = flat.pop("final", False), flat.pop("restart_at", None), flat.pop("requeue", None)
    after: dict[str, Any] | None = None
    if final:
        after = {"kind": "final"}  # a back-off it showed (restart_at) never comes: ended for good
    elif requeue is not None:
        after = {"kind": "requeue_with_gang", "reason": requeue, "at": restart_at}
    elif restart_at is not None:
        after = {"kind": "restart_at", "at": restart_at}
    stop = {"cause": cause} if cause is not None else {"cause": "requested"} if stopped else None
    return {**flat, "attempt": attempt, "stop": stop, "after": after}


class Folded(BaseModel):
    """The entries compaction took out of a run's histories (the run's, and each worker's by id) during one run of
    its workflow, oldest first. Continue-as-new passes them on in the next run's input, where they stay: clients read
    them back from there to serve the whole history (workers/folds.py). Runs of protocol 4 and later keep them."""

    model_config = ConfigDict(extra="forbid")

    run: list[StatusEntry] = Field(default_factory=list)
    tasks: dict[str, list[StatusEntry]] = Field(default_factory=dict)

    def most(self) -> int:
        """The most entries it holds of one history."""
        return max([len(self.run), *(len(entries) for entries in self.tasks.values())])


class JobRecord(BaseModel):
    """The whole state of one run, as its workflow holds it (continue-as-new carries exactly this)."""

    model_config = ConfigDict(extra="forbid")

    spec: JobSpec
    settings: Settings
    status: Status
    history: list[StatusEntry] = Field(default_factory=list)
    tasks: list[TaskRecord] = Field(default_factory=list)
    cancel_requested: bool = False
    summarised: int = 0
    barrier_round: int = 0  # a gang's barrier: which wait it is (a timer of an earlier round is stale)
    barrier_since: datetime | None = None  # when the first member of this round reached the barrier
    quota_noted: bool = False  # "Quota reached: <why>" was written
    planned: dict[str, GroupSpec] = Field(default_factory=dict)  # groups of total_gpus, as the scheduler split them
    protocol: int = 1  # how its workflow starts workers: 2, one activity starts and watches each (run_task)
    folded: Folded = Field(default_factory=Folded)  # since this run of its workflow began (protocol 4)

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


# A folded history keeps its first HEAD entries, then the summary entry, then its latest ones.
HEAD = 3


def history_long(job: JobRecord, suggested: bool, length: int) -> bool:
    """Whether the run's workflow is due to continue as new: Temporal `suggested` it, its history's `length` reached
    `continue_as_new_events`, or (since protocol 4) the run holds `history_keep` entries folded out of one of its
    histories."""
    return (
        suggested
        or length >= job.settings.continue_as_new_events
        or (job.protocol >= 4 and job.folded.most() >= job.settings.history_keep)
    )


def compact(history: list[StatusEntry], summarised: int, keep: int) -> tuple[int, list[StatusEntry]]:
    """Fold the middle of a history longer than `keep` into one summary entry; returns the new summarised count and
    the entries it folded, oldest first.

    The first entries (how it began) and the latest ones stay; nothing is dropped without being counted. The
    summary entry is dated by the first change it folds, so the history stays in order."""
    tail = keep - HEAD - 1
    if len(history) <= keep:
        return summarised, []
    start = HEAD + 1 if summarised else HEAD
    folded = history[start : len(history) - tail]
    first = history[HEAD].at if summarised else folded[0].at
    total = summarised + len(folded)
    reason = R.HistorySummarised(count=total, first=_stamp(first), last=_stamp(folded[-1].at))
    summary = StatusEntry(state=folded[-1].state, reason=reason.text, code=reason.code, at=first)
    history[HEAD : len(history) - tail] = [summary]
    return total, folded


def folded(history: list[StatusEntry]) -> bool:
    """Whether the history was folded: it has a summary entry, after its first entries."""
    return len(history) > HEAD and history[HEAD].code == R.HistorySummarised.code


def unfold(history: list[StatusEntry], entries: list[StatusEntry]) -> list[StatusEntry]:
    """A folded history with the entries its summary entry counts back in its place: `entries`, every one of them,
    oldest first. Without them (none kept) it stays as it is."""
    if not entries or not folded(history):
        return history
    return [*history[:HEAD], *entries, *history[HEAD + 1 :]]


def _stamp(at: datetime) -> str:
    return at.strftime("%Y-%m-%d %H:%M:%S UTC")


def record(status: Status, history: list[StatusEntry], state: str, reason: Reason, now: datetime) -> bool:
    """Set a status and append to its history, only if state or reason changed. Returns whether it did."""
    if status.state == state and status.reason == reason.text and history:
        return False
    status.state, status.reason, status.code = state, reason.text, reason.code
    history.append(StatusEntry(state=state, reason=reason.text, code=reason.code, at=now))
    return True
