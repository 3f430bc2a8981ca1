"""The Python client: the same verbs as the CLI (submit, ls, status, describe, events, cancel, stop, nodes)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistoryEventFilterType,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    TerminatedError,
    TimeoutError,
    WorkflowAlreadyStartedError,
)
from temporalio.service import RPCError, RPCStatusCode

from workflows.domain.nodes import NodeView
from workflows.domain.spec import JobSpec, job_id
from workflows.domain.status import RunState, Status
from workflows.domain.views import (
    TERMINATED,
    Event,
    JobDescription,
    terminated_description,
    terminated_events,
    terminated_status,
)
from workflows.job import JobWorkflow, search_attributes
from workflows.logs import LogsWorkflow
from workflows.messages import (
    CONTROL_TASK_QUEUE,
    RUN_FAILED,
    SA_NAMESPACE,
    SA_STATE,
    JobInput,
    LogsInput,
    ReadLogInput,
    StopTaskRequest,
    TaskRef,
)


class AstraeusError(Exception):
    """Bad input or an unknown object: the message names what is wrong; nothing changed."""


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
    return await _termination(handle, described.close_time)


async def _termination(handle: WorkflowHandle[Any, Any], closed: datetime | None) -> Terminated:
    why = ""
    async for event in handle.fetch_history_events(event_filter_type=WorkflowHistoryEventFilterType.CLOSE_EVENT):
        if event.HasField("workflow_execution_terminated_event_attributes"):
            why = event.workflow_execution_terminated_event_attributes.reason
            closed = closed or event.event_time.ToDatetime(tzinfo=UTC)
    return Terminated(why=why, at=closed or datetime.now(UTC))


async def run_result(handle: WorkflowHandle[Any, Any]) -> Status:
    """Wait until the run's workflow closes, and return the run's Status however it closed: a Completed run's
    workflow returns it; a Failed one's fails (RunFailed) with it as details; a Cancelled one's is Canceled, and the
    Status is read with the `status` query; a terminated one's is Terminated, with the reason Temporal recorded."""
    try:
        return Status.model_validate(await handle.result())  # a dict unless the handle was typed
    except WorkflowFailureError as error:
        cause = error.cause
        if isinstance(cause, ApplicationError) and cause.type == RUN_FAILED and cause.details:
            return Status.model_validate(cause.details[0])
        if isinstance(cause, CancelledError):
            return await handle.query("status", result_type=Status)  # type: ignore[no-any-return]
        if isinstance(cause, TerminatedError):
            status: Status = await handle.query("status", result_type=Status)
            ended = await _termination(handle, (await handle.describe()).close_time)
            return terminated_status(status, ended.why, ended.at)
        raise


class RunSummary(BaseModel):
    namespace: str
    name: str
    state: str
    reason: str


class AstraeusClient:
    def __init__(self, client: Client) -> None:
        self.temporal = client

    def _handle(self, namespace: str, name: str) -> WorkflowHandle[Any, Any]:
        return self.temporal.get_workflow_handle(job_id(namespace, name))

    async def submit(self, spec: JobSpec) -> str:
        """Start the run's workflow; a name already used in the namespace is refused."""
        try:
            await self.temporal.start_workflow(
                JobWorkflow.run,
                JobInput(spec=spec),
                id=spec.job_id,
                task_queue=CONTROL_TASK_QUEUE,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=search_attributes(spec, RunState.PENDING),
                static_summary=f"run {spec.namespace}/{spec.name}",
            )
        except WorkflowAlreadyStartedError:
            raise AstraeusError(f"a run named {spec.name} already exists in namespace {spec.namespace}") from None
        return spec.job_id

    async def _query(self, namespace: str, name: str, query: str, result_type: type[Any]) -> Any:
        try:
            return await self._handle(namespace, name).query(query, result_type=result_type)
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise AstraeusError(f"no run named {name} in namespace {namespace}") from None
            raise
        except WorkflowQueryFailedError as error:
            raise AstraeusError(f"run {namespace}/{name}: {error}") from None

    async def _terminated(self, namespace: str, name: str) -> Terminated | None:
        try:
            return await terminated(self._handle(namespace, name))
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise AstraeusError(f"no run named {name} in namespace {namespace}") from None
            raise

    async def status(self, namespace: str, name: str) -> Status:
        """The run's status; Terminated (with Temporal's reason) when its workflow was terminated."""
        status: Status = await self._query(namespace, name, "status", Status)
        ended = await self._terminated(namespace, name)
        return status if ended is None else terminated_status(status, ended.why, ended.at)

    async def describe(self, namespace: str, name: str) -> JobDescription:
        """The run, its workers and why they wait; a run whose workflow was terminated says so (status, history)."""
        described: JobDescription = await self._query(namespace, name, "describe", JobDescription)
        ended = await self._terminated(namespace, name)
        return described if ended is None else terminated_description(described, ended.why, ended.at)

    async def events(self, namespace: str, name: str) -> list[Event]:
        stream: list[Event] = await self._query(namespace, name, "events", list[Event])
        ended = await self._terminated(namespace, name)
        return stream if ended is None else terminated_events(stream, ended.why, ended.at)

    async def result(self, namespace: str, name: str) -> Status:
        """Wait until the run ends; its final Status (Completed, Failed, Cancelled, or Terminated)."""
        try:
            return await run_result(self._handle(namespace, name))
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise AstraeusError(f"no run named {name} in namespace {namespace}") from None
            raise

    async def follow(self, namespace: str, name: str, poll_seconds: float = 0.5) -> AsyncIterator[Event]:
        """Every event, then new ones as they come, until the run's workflow closes."""
        seen = 0
        handle = self._handle(namespace, name)
        while True:
            closed = (await handle.describe()).status != WorkflowExecutionStatus.RUNNING
            stream = await self.events(namespace, name)
            for event in stream[seen:]:
                yield event
            seen = len(stream)
            if closed:
                return
            await asyncio.sleep(poll_seconds)

    async def cancel(self, namespace: str, name: str) -> Status:
        return await self._update(namespace, name, "cancel", None)

    async def stop(self, namespace: str, name: str, task_id: str, reason: str | None = None) -> Status:
        return await self._update(namespace, name, "stop_task", StopTaskRequest(task_id=task_id, reason=reason))

    async def _update(self, namespace: str, name: str, update: str, arg: BaseModel | None) -> Status:
        handle = self._handle(namespace, name)
        try:
            args = [arg] if arg is not None else []
            return await handle.execute_update(update, args=args, result_type=Status)  # type: ignore[no-any-return]
        except WorkflowUpdateFailedError as error:
            cause = error.cause
            raise AstraeusError(cause.message if isinstance(cause, ApplicationError) else str(cause)) from None
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            status = await self.status(namespace, name)  # raises "no run named ..." when there is none
            raise AstraeusError(f"run {namespace}/{name} already ended: {status.state}") from None

    async def logs(
        self, namespace: str, name: str, task_id: str, lines: int = 100_000, max_bytes: int = 1 << 20
    ) -> str:
        """A worker's output (its current attempt's), read on the machine that runs or ran it."""
        described = await self.describe(namespace, name)
        task = next((t for t in described.tasks if t.id == task_id), None)
        if task is None:
            raise AstraeusError(f"run {namespace}/{name} has no worker {task_id}")
        if task.node is None:
            raise AstraeusError(f"worker {task_id} of run {name} is on no machine now ({task.status.state})")
        ref = TaskRef(namespace=namespace, job=name, task_id=task_id, attempt=task.attempt)
        read = ReadLogInput(ref=ref, lines=lines, max_bytes=max_bytes)
        request = LogsInput(node=task.node, read=read)
        try:
            result = await self.temporal.execute_workflow(
                LogsWorkflow.run,
                request,
                id=f"logs/{namespace}/{name}/{task_id}/{uuid.uuid4()}",
                task_queue=CONTROL_TASK_QUEUE,
                execution_timeout=timedelta(seconds=request.answer_within_seconds + 10),
            )
        except WorkflowFailureError as error:
            cause = error.cause.cause if isinstance(error.cause, ActivityError) else error.cause
            if isinstance(cause, TimeoutError):
                why = f"it did not answer within {request.answer_within_seconds:g} s (is its agent running?)"
            else:
                why = str(cause)
            raise AstraeusError(f"cannot read the log of {task_id} on machine {task.node}: {why}") from None
        return result.text

    async def ls(self, namespace: str | None = None, state: str | None = None) -> list[RunSummary]:
        """Runs, newest first, filtered by namespace and state (search attributes). A run whose workflow was
        terminated is Terminated, whatever state it last recorded (its AstraeusState stays that one)."""
        query = 'WorkflowType="JobWorkflow"'
        if namespace:
            query += f' AND {SA_NAMESPACE}="{_quote(namespace)}"'
        if state == TERMINATED:
            query += ' AND ExecutionStatus="Terminated"'
        elif state:
            query += f' AND {SA_STATE}="{_quote(state)}" AND ExecutionStatus!="Terminated"'
        runs = []
        async for wf in self.temporal.list_workflows(query):
            _, ns, name = wf.id.split("/", 2)
            try:
                status = await self._query(ns, name, "status", Status)
                if wf.status == WorkflowExecutionStatus.TERMINATED:
                    ended = await _termination(self._handle(ns, name), wf.close_time)
                    status = terminated_status(status, ended.why, ended.at)
            except AstraeusError:
                continue
            runs.append(RunSummary(namespace=ns, name=name, state=status.state, reason=status.reason))
        return runs

    async def nodes(self) -> list[NodeView]:
        views = []
        async for wf in self.temporal.list_workflows('WorkflowType="NodeWorkflow" AND ExecutionStatus="Running"'):
            views.append(await self.temporal.get_workflow_handle(wf.id).query("view", result_type=NodeView))
        return sorted(views, key=lambda v: v.name)


def _quote(value: str) -> str:
    if '"' in value or "\\" in value:
        raise AstraeusError(f"filter value {value!r} may not contain quotes or backslashes")
    return value
