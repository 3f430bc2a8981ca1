"""Whether and when an ended worker starts again: policy, back-off, budget and reset."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from workflows.domain.reasons import R, Reason
from workflows.domain.run.status import TaskState
from workflows.domain.settings import Settings
from workflows.domain.spec import RestartPolicy

# restart_policy -> the ended states it restarts (the spec's "Restarts" table).
RESTARTS_AFTER: dict[str, frozenset[TaskState]] = {
    "OnFailure": frozenset({TaskState.FAILED, TaskState.DOWN}),
    "Always": frozenset({TaskState.FAILED, TaskState.DOWN, TaskState.COMPLETED}),
    "Never": frozenset(),
}


@dataclass(frozen=True)
class RestartDecision:
    """`restart_at` None means the worker ended for good; `final_reason` then replaces its reason, if set."""

    restarts: int
    restart_at: datetime | None
    final_reason: Reason | None = None


def backoff(restarts: int, settings: Settings) -> timedelta:
    """10 s before the first restart, doubling each time, at most 5 min."""
    seconds = settings.backoff_base_seconds * 2 ** min(restarts, 32)
    return timedelta(seconds=min(seconds, settings.backoff_cap_seconds))


def decide_restart(
    policy: RestartPolicy,
    ended: TaskState,
    restarts: int,
    running_since: datetime | None,
    now: datetime,
    settings: Settings,
) -> RestartDecision:
    """Decide for a worker that just ended in `ended` after `restarts` restarts."""
    if running_since is not None and now - running_since >= timedelta(seconds=settings.restart_reset_seconds):
        restarts = 0  # it stayed Running for the reset window: its count starts again
    if ended not in RESTARTS_AFTER[policy]:
        return RestartDecision(restarts, None)
    if ended is TaskState.COMPLETED:
        restarts = 0  # a success is no crash: the budget and the back-off start again (restart_policy Always)
    elif restarts >= settings.restart_budget:
        exhausted = R.RetryBudgetExhausted(restarts=restarts, budget=settings.restart_budget)
        return RestartDecision(restarts, None, exhausted)
    return RestartDecision(restarts, now + backoff(restarts, settings))


def restarted_reason(restarts: int, settings: Settings) -> Reason:
    """The reason of a worker queued again by its policy, `restarts` counting this one."""
    return R.RestartedByPolicy(restart=restarts, budget=settings.restart_budget)
