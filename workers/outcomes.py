"""How a run's workflow ended, read from Temporal: the run's Status however its workflow closed, and whether it was
terminated (and why)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistoryEventFilterType,
)
from temporalio.exceptions import ApplicationError, CancelledError, TerminatedError

from workflows import contracts
from workflows.domain.run.status import Status
from workflows.domain.run.views import terminated_status
from workflows.messages import RUN_FAILED

ASK_AGAIN_SECONDS = 0.1  # between two reads of a run being created, or two waits for its end
NO_CLOSE_EVENT = "No completion event found"  # what the SDK raises when a wait for the close event ends empty


class Terminated(BaseModel):
    """How a run's workflow was terminated in Temporal: the reason recorded, and when."""

    why: str
    at: datetime


async def terminated(handle: WorkflowHandle[Any, Any]) -> Terminated | None:
    """Whether the run's workflow was terminated (the UI's Terminate button): then it decides nothing more, and
    what its queries answer is what the run last recorded. Raises RPCError NOT_FOUND when there is no such run."""
    described = await handle.describe()
    if described.status != WorkflowExecutionStatus.TERMINATED:
        return None
    return await termination(handle, described.close_time)


async def termination(handle: WorkflowHandle[Any, Any], closed: datetime | None) -> Terminated:
    """How the workflow was terminated: the reason in its close event, and when (`closed`, else that event's time)."""
    why = ""
    async for event in handle.fetch_history_events(event_filter_type=WorkflowHistoryEventFilterType.CLOSE_EVENT):
        if event.HasField("workflow_execution_terminated_event_attributes"):
            why = event.workflow_execution_terminated_event_attributes.reason
            closed = closed or event.event_time.ToDatetime(tzinfo=UTC)
    return Terminated(why=why, at=closed or datetime.now(UTC))


async def _result(handle: WorkflowHandle[Any, Any]) -> Any:
    """The workflow's result. Temporal's time-skipping test server may end the long poll for the close event with
    neither an event nor a page token, which the SDK reports as "No completion event found" (the .NET and Ruby SDKs
    wait again: temporalio/sdk-dotnet#78, temporalio/sdk-ruby#506): so do we."""
    while True:
        try:
            return await handle.result()
        except RuntimeError as error:
            if str(error) != NO_CLOSE_EVENT:
                raise
        await asyncio.sleep(ASK_AGAIN_SECONDS)


async def run_result(handle: WorkflowHandle[Any, Any]) -> Status:
    """Wait until the run's workflow closes, and return the run's Status however it closed: a Completed run's
    workflow returns it; a Failed one's fails (RunFailed) with it as details; a Cancelled one's is Canceled, and the
    Status is read with the `status` query; a terminated one's is Terminated, with the reason Temporal recorded."""
    try:
        return Status.model_validate(await _result(handle))  # a dict unless the handle was typed
    except WorkflowFailureError as error:
        cause = error.cause
        if isinstance(cause, ApplicationError) and cause.type == RUN_FAILED and cause.details:
            return Status.model_validate(cause.details[0])
        if isinstance(cause, CancelledError):
            return await contracts.query(handle, contracts.STATUS)
        if isinstance(cause, TerminatedError):
            status = await contracts.query(handle, contracts.STATUS)
            ended = await termination(handle, (await handle.describe()).close_time)
            return terminated_status(status, ended.why, ended.at)
        raise
