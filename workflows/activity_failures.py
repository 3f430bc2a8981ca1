"""How an activity's failure reads in a workflow: a cancellation, a missed heartbeat, a setup the agent refused, and
the reason a failed start carries. Sandbox-safe: temporalio and the pure core only."""

from __future__ import annotations

import asyncio

from temporalio import exceptions as temporal_errors
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, TimeoutType

from workflows.domain import reasons


def cancellation(error: BaseException) -> bool:
    """Whether `error` is how a cancellation of this coroutine shows: at a timer or condition, or at an activity."""
    if isinstance(error, asyncio.CancelledError):
        return True
    return isinstance(error, ActivityError) and isinstance(error.cause, CancelledError)


def heartbeat_missed(error: ActivityError) -> bool:
    cause = error.cause
    return isinstance(cause, temporal_errors.TimeoutError) and cause.type == TimeoutType.HEARTBEAT


def setup_failed(error: ActivityError) -> bool:
    """The agent said why the worker cannot be set up or started (a reason of its own, final)."""
    cause = error.cause
    return isinstance(cause, ApplicationError) and bool(cause.type) and cause.non_retryable


def start_failure(error: ActivityError) -> reasons.Reason:
    """The reason an agent put on a failed start (its code as the error's type, its sentence as the message); an
    unexplained failure is a start failure."""
    cause = error.cause
    if isinstance(cause, ApplicationError) and cause.type:
        return reasons.Reason(cause.type, cause.message)
    return reasons.R.ContainerStartFailed(error=str(cause or error))
