"""A worker's output and its interactive sessions, reached on its machine through a short workflow (LogsWorkflow,
SessionWorkflow)."""

from __future__ import annotations

import uuid
from datetime import timedelta

from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

from workers.errors import AstraeusError, SessionRefused
from workflows import contracts
from workflows.contracts import CONTROL_TASK_QUEUE
from workflows.domain.refs import TaskRef
from workflows.domain.run.views import TaskView
from workflows.logs import LogsWorkflow
from workflows.messages import LogsInput, ReadLogInput, SessionInput, SessionOutput
from workflows.sessions import SessionWorkflow


def new_output(shown: str, text: str) -> str:
    """What `text`, the latest tail of a log, adds to `shown`, the tail read before. A tail is a window that slides
    forward as the log grows: the new one begins at a line of the old one (the earliest that matches, the longest
    overlap), or after it when more than a window was written meanwhile (then all of it is new)."""
    start = 0
    while not text.startswith(shown[start:]):
        start = shown.find("\n", start) + 1 or len(shown)
    return text[len(shown) - start :]


async def read_log(
    temporal: Client, namespace: str, name: str, task: TaskView, node: str, lines: int, max_bytes: int
) -> str:
    ref = TaskRef(namespace=namespace, job=name, task_id=task.id, attempt=task.attempt)
    read = ReadLogInput(ref=ref, lines=lines, max_bytes=max_bytes)
    request = LogsInput(node=node, read=read)
    try:
        result = await temporal.execute_workflow(
            LogsWorkflow.run,
            request,
            id=f"logs/{namespace}/{name}/{task.id}/{uuid.uuid4()}",
            task_queue=CONTROL_TASK_QUEUE,
            execution_timeout=timedelta(seconds=request.answer_within_seconds + 10),
        )
    except WorkflowFailureError as error:
        cause = error.cause.cause if isinstance(error.cause, ActivityError) else error.cause
        if isinstance(cause, TimeoutError):
            why = f"it did not answer within {request.answer_within_seconds:g} s (is its agent running?)"
        else:
            why = str(cause)
        raise AstraeusError(f"cannot read the log of {task.id} on machine {node}: {why}") from None
    return result.text


async def ask_session(
    temporal: Client, namespace: str, name: str, task: TaskView, request: SessionInput
) -> SessionOutput:
    timeout = request.answer_within_seconds + (request.attach.timeout_seconds if request.attach else 0)
    try:
        return await temporal.execute_workflow(
            SessionWorkflow.run,
            request,
            id=f"{contracts.session_id_prefix(namespace, name)}{task.id}/{uuid.uuid4()}",
            task_queue=CONTROL_TASK_QUEUE,
            execution_timeout=timedelta(seconds=timeout + 20),
        )
    except WorkflowFailureError as error:
        cause = error.cause.cause if isinstance(error.cause, ActivityError) else error.cause
        if isinstance(cause, TimeoutError):
            why = f"it did not answer within {request.answer_within_seconds:g} s (is its agent running?)"
            raise AstraeusError(f"machine {request.node}: {why}") from None
        if isinstance(cause, ApplicationError) and cause.type == "SessionRefused":
            raise SessionRefused(cause.message) from None
        raise AstraeusError(cause.message if isinstance(cause, ApplicationError) else str(cause)) from None
