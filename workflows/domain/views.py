"""What users read: `describe` and `events`, derived from a run's record (events are never stored twice)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict

from workflows.domain.status import JobRecord, LastFailure, Placement, Status, StatusEntry


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
                node=t.node,
                attempt=t.attempt,
                restarts=t.restarts,
                restart_at=t.restart_at,
                status=t.status,
                history=t.history,
                last_failure=t.last_failure,
                healthy=t.healthy,
            )
            for t in job.tasks
        ],
        placement=Placement(nodes=next((t.waiting_on for t in job.tasks if t.waiting_on), [])),
    )


def events(job: JobRecord) -> list[Event]:
    """Every change of the run and its workers, oldest first; at equal times the run comes first."""
    stream = [Event(at=e.at, object="run", state=e.state, reason=e.reason, code=e.code) for e in job.history]
    for task in job.tasks:
        stream += [Event(at=e.at, object=task.id, state=e.state, reason=e.reason, code=e.code) for e in task.history]
    order = {id(e): i for i, e in enumerate(stream)}
    return sorted(stream, key=lambda e: (e.at, order[id(e)]))
