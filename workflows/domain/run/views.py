"""What users read: `describe` and `events`, derived from a run's record (events are never stored twice)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

from workflows.domain.reasons import R
from workflows.domain.run.status import Folded, JobRecord, LastFailure, Placement, Status, StatusEntry, folded, unfold

# What clients show for a run whose workflow was terminated in Temporal (the UI's Terminate button). No workflow
# holds this state: a terminated workflow decides nothing more, so the client adds it to what the run last recorded.
TERMINATED = "Terminated"

T = TypeVar("T")


class TaskView(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    group: str
    node: str | None
    attempt: int
    restarts: int
    restart_at: datetime | None
    status: Status
    history: list[StatusEntry]
    last_failure: LastFailure | None
    healthy: bool | None = None  # its group's readiness check, while it runs (None: no check, or not yet)
    external: dict[str, str] = {}  # its external access: name -> "<machine address>:<port>", once started
    node_address: str | None = None  # network.mesh: its address on its machine's subnet, once started


class JobDescription(BaseModel):
    """`astraeus describe --json`: the run, its status and history, each worker, and the placement."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    namespace: str
    name: str
    spec: dict[str, Any]
    status: Status
    history: list[StatusEntry]
    tasks: list[TaskView]
    placement: Placement


class Event(BaseModel):
    """One change of the run or of a worker, as an event stream shows it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    at: datetime
    object: str
    state: str
    reason: str
    code: str


def describe(job: JobRecord) -> JobDescription:
    return JobDescription(
        id=job.id,
        namespace=job.spec.namespace,
        name=job.spec.name,
        spec=job.spec.model_dump(mode="json"),
        status=job.status,
        history=job.history,
        tasks=[
            TaskView(
                id=t.id,
                group=t.group,
                node=t.attempt.node,
                attempt=t.attempt.number,
                restarts=t.restarts,
                restart_at=t.restart_at,
                status=t.status,
                history=t.history,
                last_failure=t.last_failure,
                healthy=t.attempt.healthy,
                external=t.attempt.external,
                node_address=t.attempt.node_address,
            )
            for t in job.tasks
        ],
        placement=Placement.of(next((t.waiting_on for t in job.tasks if t.waiting_on), [])),
    )


def events(job: JobRecord | JobDescription) -> list[Event]:
    """Every change of the run and its workers, oldest first; at equal times the run comes first."""
    stream = [Event(at=e.at, object="run", state=e.state, reason=e.reason, code=e.code) for e in job.history]
    for task in job.tasks:
        stream += [Event(at=e.at, object=task.id, state=e.state, reason=e.reason, code=e.code) for e in task.history]
    order = {id(e): i for i, e in enumerate(stream)}
    return sorted(stream, key=lambda e: (e.at, order[id(e)]))


def unfolded(described: JobDescription, folds: list[Folded]) -> JobDescription:
    """`describe` with every history whole: the entries each run of the workflow folded out of it (`folds`, one per
    run, oldest first) back in place of its summary entry."""
    tasks = [
        t.model_copy(update={"history": unfold(t.history, [e for fold in folds for e in fold.tasks.get(t.id, [])])})
        for t in described.tasks
    ]
    history = unfold(described.history, [e for fold in folds for e in fold.run])
    return described.model_copy(update={"history": history, "tasks": tasks})


def summarised(described: JobDescription) -> bool:
    """Whether a history of the run was folded: its summary entry counts entries that runs of its workflow kept."""
    return any(folded(h) for h in [described.history, *(t.history for t in described.tasks)])


def summarised_record(job: JobRecord) -> bool:
    """Whether a history of the run was folded before (the record a run of its workflow was continued with)."""
    return job.summarised > 0 or any(t.summarised > 0 for t in job.tasks)


def paged(described: JobDescription, after: int, limit: int | None) -> JobDescription:
    """`describe` with a page of each history: the entries after its first `after`, `limit` at most."""
    tasks = [t.model_copy(update={"history": page(t.history, after, limit)}) for t in described.tasks]
    return described.model_copy(update={"history": page(described.history, after, limit), "tasks": tasks})


def page(entries: list[T], after: int, limit: int | None) -> list[T]:
    """The entries after the first `after`, `limit` at most (a history only grows at its end: pages stay put)."""
    return entries[after : None if limit is None else after + limit]


def terminated_entry(why: str, at: datetime) -> StatusEntry:
    """The last entry of a run whose workflow was terminated at `at`, with the reason Temporal recorded."""
    reason = R.RunTerminated(why=why or "no reason given")
    return StatusEntry(state=TERMINATED, reason=reason.text, code=reason.code, at=at)


def terminated_status(status: Status, why: str, at: datetime) -> Status:
    """The run's status once its workflow was terminated: Terminated, and why, since `at`."""
    entry = terminated_entry(why, at)
    return status.model_copy(
        update={"state": entry.state, "reason": entry.reason, "code": entry.code, "finished_at": at}
    )


def terminated_description(described: JobDescription, why: str, at: datetime) -> JobDescription:
    """`describe` of a run whose workflow was terminated: its status and a last history entry say so; its workers
    show what the run last knew of them (their machines' agents stop what still runs)."""
    return described.model_copy(
        update={
            "status": terminated_status(described.status, why, at),
            "history": [*described.history, terminated_entry(why, at)],
        }
    )


def terminated_events(stream: list[Event], why: str, at: datetime) -> list[Event]:
    """The run's events, then the termination."""
    entry = terminated_entry(why, at)
    return [*stream, Event(at=at, object="run", state=entry.state, reason=entry.reason, code=entry.code)]
