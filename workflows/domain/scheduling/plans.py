"""What a scheduling pass decides: a machine or a reason for each waiting worker, the preemptions to carry out,
and the room held for heads (a Plan, which the scheduler service carries out)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from workflows.domain.reasons import NodeReasons, Reason
from workflows.domain.requests import JobTaskKey, TaskRequest


@dataclass(frozen=True)
class Decision:
    """A machine for the request, or the reason it waits with every machine's reasons; `reached` is the
    "Quota reached: <why>" entry for its run's history when it waits on quota."""

    request: TaskRequest
    node: str | None
    reason: Reason | None = None
    nodes: list[NodeReasons] = field(default_factory=list)
    reached: Reason | None = None


@dataclass(frozen=True)
class Preemption:
    """Stop these workers of one run (signal `preempt`) to make room for the head worker `head`; `by` is how the
    victims' reasons name the head's run."""

    job_id: str
    task_ids: tuple[str, ...]
    by: str
    head: JobTaskKey


@dataclass
class Plan:
    decisions: list[Decision] = field(default_factory=list)
    preemptions: list[Preemption] = field(default_factory=list)
    wake_at: datetime | None = None  # decide again then, even if nothing happens (a patience window moves)
    holds: dict[JobTaskKey, tuple[str, datetime | None]] = field(default_factory=dict)  # head worker -> machine, start

    def decision(self, key: JobTaskKey) -> Decision:
        return next(d for d in self.decisions if d.request.key == key)
