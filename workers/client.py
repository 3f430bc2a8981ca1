"""The Python client: the same verbs as the CLI (submit, ls, status, describe, events, cancel, stop, nodes)."""

from __future__ import annotations

import asyncio
import base64
import gc
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from pydantic import BaseModel
from temporalio.client import (
    Client,
    WorkflowExecution,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowHistoryEventFilterType,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributeKey,
    SearchAttributePair,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    TerminatedError,
    TimeoutError,
    WorkflowAlreadyStartedError,
)
from temporalio.service import RPCError, RPCStatusCode

from activities import session_token
from activities.deletion import deleted, tombstones
from workflows import contracts
from workflows.contracts import (
    CONTROL_TASK_QUEUE,
    DRIVES_WORKFLOW_ID,
    PRIORITY_KEY,
    SA_NAMESPACE,
    SA_STATE,
    STATE_KEY,
    In,
    Out,
)
from workflows.deletion import DeleteRunWorkflow
from workflows.domain.constraints import Drive
from workflows.domain.inventory import NodeView
from workflows.domain.refs import TaskRef
from workflows.domain.requests import Allocation
from workflows.domain.run.status import TASK_ENDED, Folded, JobRecord, RunState, Status
from workflows.domain.run.views import (
    TERMINATED,
    Event,
    JobDescription,
    TaskView,
    page,
    paged,
    summarised,
    summarised_record,
    terminated_description,
    terminated_events,
    terminated_status,
    unfolded,
)
from workflows.domain.run.views import events as events_of
from workflows.domain.scheduling.use import ClusterUse, cluster_use
from workflows.domain.spec import JobSpec, job_id
from workflows.domain.tombstones import DELETED, Tombstone
from workflows.job import JobWorkflow, search_attributes
from workflows.logs import LogsWorkflow
from workflows.messages import (
    RUN_FAILED,
    Attached,
    AttachInput,
    DeleteRunInput,
    GrantSessionInput,
    JobInput,
    LogsInput,
    ReadLogInput,
    SessionInput,
    SessionOutput,
    StopTaskRequest,
)
from workflows.sessions import SessionWorkflow

CREATING_SECONDS = 60.0  # how long a read waits for a run just submitted to make its record
ASK_AGAIN_SECONDS = 0.1  # between two reads of a run being created, or two waits for its end
NO_CLOSE_EVENT = "No completion event found"  # what the SDK raises when a wait for the close event ends empty
_LET_GO_SECONDS = 0.1  # AstraeusClient.close: time for the SDK's threads to let go of a dropped connection

# A submit is admitted behind the work of the runs already admitted. Every write of a workflow's state waits for the
# one I/O slot of its history shard (`history.shardIOConcurrency`), first come first served, except that a caller
# of type "preemptable" waits until no other caller does (and comes last under the persistence rate limit, too).
# Temporal marks its own standby tasks and batch jobs so, "to avoid impacting active traffic". A new run's write so
# marked no longer delays a start handed to a machine, a decision or a heartbeat of a run under way: those wait
# behind a burst's submits no more. A submit waits longer in a burst, and alone no longer (bench/README.md).
# Nor is a start eager (`request_eager_start`: the run's first workflow task started in the start's own write and
# handed back with its answer, to this process's worker). That saved a write, but an eager run came before the
# scheduler ahead of runs submitted earlier, whose first tasks waited in the queue: with ten at a time, 4 to 10 of
# the first 512 runs of a 1,000-run burst waited behind later ones; with one at a time, 1; with none, none.
SUBMIT_METADATA = {"caller-type": "preemptable"}

# Temporal's predefined attribute naming the worker builds that took a workflow's tasks. As a build completes its
# first task of a run, the server adds it and, the list changed, writes the run's listing again: one of the three
# listing writes a run cost on its way to Running (the visibility store's writes were two thirds of the dev server's
# database time per run in a burst, bench/README.md). A client beside the control plane knows the build that takes
# its runs' tasks (`control_build`): it lists it at the start, in the form the server writes for a worker without
# versioning (the control plane's has none), and the server finds nothing to add. Should another build take the task
# (the control plane upgraded meanwhile), the server adds that one, with its own write.
BUILD_IDS_KEY = SearchAttributeKey.for_keyword_list("BuildIds")


def listed_builds(build_id: str) -> list[str]:
    """What the server lists in BuildIds for a workflow whose tasks a worker of this build without versioning took."""
    return ["unversioned", f"unversioned:{build_id}"]


class AstraeusError(Exception):
    """Bad input: the message names what is wrong; nothing changed."""


class NotFound(AstraeusError):
    """No such run, worker, machine or quota."""


class Unreachable(AstraeusError):
    """Temporal cannot be reached."""


class SessionRefused(AstraeusError):
    """An interactive token refused, or a worker that hosts no session: the message says why."""


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
            ended = await _termination(handle, (await handle.describe()).close_time)
            return terminated_status(status, ended.why, ended.at)
        raise


class RunSummary(BaseModel):
    """One run as `astraeus ls` shows it: read from the visibility store, never by asking the run."""

    namespace: str
    name: str
    state: str
    created_at: datetime
    priority: int | None = None
    workers: int | None = None  # as its spec asks (a group of total_gpus: its machines, else 1)
    gpus: int | None = None  # GPUs its spec asks for in all
    deleted_by: str | None = None  # a deleted run (state Deleted, listed with include_deleted): who deleted it
    deleted_at: datetime | None = None
    last_state: str | None = None  # ... and the state it was in then


class RunPage(BaseModel):
    """A page of `ls`: the runs, newest first, and the token of the next page (None on the last)."""

    runs: list[RunSummary]
    next_page: str | None = None


def run_memo(spec: JobSpec, now: datetime) -> dict[str, Any]:
    """What `ls` shows of a run that its search attributes do not hold: written once at submit, carried across
    continue-as-new by Temporal."""
    workers = sum((g.machines or 1) if g.planned else g.replicas for g in spec.groups)
    gpus = sum(g.total_gpus or 0 if g.planned else g.replicas * g.gpus for g in spec.groups)
    return {"workers": workers, "gpus": gpus, "created_at": now.isoformat()}


async def summary(wf: WorkflowExecution) -> RunSummary:
    """A run's line of `ls`, from its visibility record alone (search attributes and memo)."""
    _, ns, name = wf.id.split("/", 2)
    attrs = wf.typed_search_attributes
    state = TERMINATED if wf.status == WorkflowExecutionStatus.TERMINATED else attrs.get(STATE_KEY) or "?"
    memo = await wf.memo()
    created = datetime.fromisoformat(memo["created_at"]) if "created_at" in memo else wf.start_time
    return RunSummary(namespace=ns, name=name, state=state, created_at=created, priority=attrs.get(PRIORITY_KEY),
                      workers=memo.get("workers"), gpus=memo.get("gpus"))  # fmt: skip


def deleted_summary(tombstone: Tombstone) -> RunSummary:
    """A deleted run's line of `ls --include-deleted`, from its tombstone."""
    return RunSummary(
        namespace=tombstone.namespace,
        name=tombstone.name,
        state=DELETED,
        created_at=tombstone.created_at or tombstone.deleted_at,
        deleted_by=tombstone.deleted_by,
        deleted_at=tombstone.deleted_at,
        last_state=tombstone.last_state,
    )


class _Given(NamedTuple):
    """What a run of a run's workflow was continued with, for its history: the entries the run before it folded
    (None: no run before it kept any), and that run's id."""

    folded: Folded | None
    previous: str


class AstraeusClient:
    """Astraeus's verbs over a Temporal client. Use it as `async with AstraeusClient(...) as client:` (or call
    `close`) in a script, so that the process ends cleanly. `control_build`: the build of the control plane's worker
    serving on this client in this process (`Embedded.control_build`), listed on each run at its start
    (BUILD_IDS_KEY); None elsewhere (the CLI, `astraeus api` apart)."""

    def __init__(self, client: Client, control_build: str | None = None) -> None:
        self.temporal = client
        self.control_build = control_build
        self._inputs: dict[tuple[str, str], _Given] = {}  # by workflow and run id

    async def __aenter__(self) -> AstraeusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Let go of the Temporal connection while the event loop still runs. The SDK's client has no close of its
        own, and a process that ends while its threads still hold a connection can crash as the interpreter
        finalizes, after all its work is done (temporalio/sdk-python#300: SIGSEGV or SIGABRT in 1 to 7 runs of 10
        of a short script here). Dropped, collected and given a moment, it does not. The client is unusable after."""
        del self.temporal
        self._inputs.clear()
        gc.collect()
        await asyncio.sleep(_LET_GO_SECONDS)

    def _handle(self, namespace: str, name: str) -> WorkflowHandle[Any, Any]:
        return self.temporal.get_workflow_handle(job_id(namespace, name))

    async def submit(self, spec: JobSpec) -> str:
        """Start the run's workflow; a name already used in the namespace is refused, unless that run was deleted
        (Temporal may still hold its closed workflow for a while: the name is free once its tombstone is kept)."""
        try:
            await self._start(spec, WorkflowIDReusePolicy.REJECT_DUPLICATE)
        except WorkflowAlreadyStartedError:
            taken = AstraeusError(f"a run named {spec.name} already exists in namespace {spec.namespace}")
            try:
                info = await self._handle(spec.namespace, spec.name).describe()
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:
                    raise
                info = None  # removed meanwhile: the name is free
            if info is not None and (
                info.status == WorkflowExecutionStatus.RUNNING
                or await deleted(self.temporal, spec.namespace, spec.name, info.run_id) is None
            ):
                raise taken from None
            try:  # only a closed workflow is replaced; a run started meanwhile by another submit wins
                await self._start(spec, WorkflowIDReusePolicy.ALLOW_DUPLICATE)
            except WorkflowAlreadyStartedError:
                raise taken from None
        return spec.job_id

    async def _start(self, spec: JobSpec, reuse: WorkflowIDReusePolicy) -> None:
        listed = search_attributes(spec, RunState.PENDING)
        if self.control_build is not None:
            listed = listed.updated(SearchAttributePair(BUILD_IDS_KEY, listed_builds(self.control_build)))
        await self.temporal.start_workflow(
            JobWorkflow.run,
            JobInput(spec=spec),
            id=spec.job_id,
            task_queue=CONTROL_TASK_QUEUE,
            id_reuse_policy=reuse,
            search_attributes=listed,
            memo=run_memo(spec, datetime.now(UTC)),
            static_summary=f"run {spec.namespace}/{spec.name}",
            rpc_metadata=SUBMIT_METADATA,
        )

    async def delete(self, namespace: str, name: str, by: str = "") -> Tombstone:
        """Delete the run: cancel it if it is active (its workers stopped with "Run deleted"), remove its workers'
        files and logs on their machines, and forget it; its name is free again, and `ls` with `include_deleted`
        shows its tombstone. Waits until it is done; a second delete of the same run meanwhile waits with it."""
        await self._served(namespace, name)  # "no run named ..." for one that does not exist, or was deleted
        try:
            return await self.temporal.execute_workflow(
                DeleteRunWorkflow.run,
                DeleteRunInput(namespace=namespace, name=name, by=by or "unknown"),
                id=contracts.delete_id(namespace, name),
                task_queue=CONTROL_TASK_QUEUE,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                static_summary=f"delete run {namespace}/{name}",
            )
        except WorkflowFailureError as error:
            cause = error.cause.cause if isinstance(error.cause, ActivityError) else error.cause
            if isinstance(cause, ApplicationError) and cause.type == "NoSuchRun":
                raise NotFound(cause.message) from None
            raise AstraeusError(f"cannot delete run {namespace}/{name}: {cause}") from None

    async def _served(self, namespace: str, name: str) -> None:
        """Raise NotFound unless the run exists and was not deleted."""
        try:
            info = await self._handle(namespace, name).describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise NotFound(f"no run named {name} in namespace {namespace}") from None
            raise
        await self._not_deleted(namespace, name, info.status, info.run_id)

    async def _not_deleted(
        self, namespace: str, name: str, status: WorkflowExecutionStatus | None, run_id: str | None
    ) -> None:
        """A closed workflow run may be a deleted run's that Temporal has not removed yet: it is not served."""
        if status == WorkflowExecutionStatus.RUNNING or run_id is None:
            return
        if await deleted(self.temporal, namespace, name, run_id) is not None:
            raise NotFound(f"no run named {name} in namespace {namespace}")

    async def deleted_runs(self, namespace: str | None = None) -> list[Tombstone]:
        """The tombstones of deleted runs, newest first (of one namespace when given)."""
        return await tombstones(self.temporal, namespace)

    async def _query(self, namespace: str, name: str, query: contracts.Query[None, Out]) -> Out:
        return await self._ask(self._handle(namespace, name), namespace, name, query)

    async def _ask(
        self, handle: WorkflowHandle[Any, Any], namespace: str, name: str, query: contracts.Query[None, Out]
    ) -> Out:
        """The run's answer. A run just submitted may not have made its record yet (its first workflow task waits on
        a busy cluster): it is asked again until it has, for up to CREATING_SECONDS."""
        deadline = asyncio.get_running_loop().time() + CREATING_SECONDS
        while True:
            try:
                return await contracts.query(handle, query)
            except RPCError as error:
                if error.status == RPCStatusCode.NOT_FOUND:
                    raise NotFound(f"no run named {name} in namespace {namespace}") from None
                raise
            except WorkflowQueryFailedError as error:
                if contracts.BEING_CREATED not in str(error) or asyncio.get_running_loop().time() > deadline:
                    raise AstraeusError(f"run {namespace}/{name}: {error}") from None
            await asyncio.sleep(ASK_AGAIN_SECONDS)

    async def _terminated(self, namespace: str, name: str) -> Terminated | None:
        handle = self._handle(namespace, name)
        try:
            described = await handle.describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise NotFound(f"no run named {name} in namespace {namespace}") from None
            raise
        await self._not_deleted(namespace, name, described.status, described.run_id)
        if described.status != WorkflowExecutionStatus.TERMINATED:
            return None
        return await _termination(handle, described.close_time)

    async def status(self, namespace: str, name: str) -> Status:
        """The run's status; Terminated (with Temporal's reason) when its workflow was terminated."""
        status = await self._query(namespace, name, contracts.STATUS)
        ended = await self._terminated(namespace, name)
        return status if ended is None else terminated_status(status, ended.why, ended.at)

    async def describe(self, namespace: str, name: str, *, after: int = 0, limit: int | None = None) -> JobDescription:
        """The run, its workers and why they wait, each history whole, across continue-as-new (or a page of each:
        the entries after its first `after`, `limit` at most); a run whose workflow was terminated says so (status,
        history)."""
        described, ended = await self._whole(namespace, name)
        if ended is not None:
            described = terminated_description(described, ended.why, ended.at)
        return paged(described, after, limit)

    async def events(self, namespace: str, name: str, *, after: int = 0, limit: int | None = None) -> list[Event]:
        """Every change of the run and its workers, oldest first, derived from its whole histories (or a page: the
        events after the first `after`, `limit` at most)."""
        described, ended = await self._whole(namespace, name)
        stream = events_of(described)
        if ended is not None:
            stream = terminated_events(stream, ended.why, ended.at)
        return page(stream, after, limit)

    async def _whole(self, namespace: str, name: str) -> tuple[JobDescription, Terminated | None]:
        """The run as its latest workflow run describes it, each history whole, and how its workflow was terminated,
        if it was. A long history is folded in the run's record (its first entries, a summary entry, its latest
        ones): the entries folded are put back from the runs of the workflow that kept them (`_folds`)."""
        handle = self._handle(namespace, name)
        try:
            info = await handle.describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise NotFound(f"no run named {name} in namespace {namespace}") from None
            raise
        await self._not_deleted(namespace, name, info.status, info.run_id)
        latest = self.temporal.get_workflow_handle(handle.id, run_id=info.run_id)  # one run answers every question
        described = await self._ask(latest, namespace, name, contracts.DESCRIBE)
        if summarised(described):
            folds = await self._folds(latest, namespace, name)
            described = described if folds is None else unfolded(described, folds)
        if info.status != WorkflowExecutionStatus.TERMINATED:
            return described, None
        return described, await _termination(latest, info.close_time)

    async def _folds(self, latest: WorkflowHandle[Any, Any], namespace: str, name: str) -> list[Folded] | None:
        """What each run of the workflow folded out of the run's histories, oldest first: the latest run answers for
        itself, and each earlier one's is in the input the run after it was continued with. None when Temporal no
        longer keeps one of them (it keeps a closed run for its namespace's retention): the summary entry stays."""
        folds: list[Folded] = [await self._ask(latest, namespace, name, contracts.FOLDED)]
        run_id = latest.run_id
        while run_id:
            given = await self._given(latest.id, run_id)
            if given is None:
                return None
            if given.folded is None:
                return folds[::-1]
            folds.append(given.folded)
            run_id = given.previous
        return None

    async def _given(self, workflow_id: str, run_id: str) -> _Given | None:
        """What one run of a workflow was continued with (its input never changes: it is read once), or None when
        Temporal no longer has that run."""
        if (workflow_id, run_id) in self._inputs:
            return self._inputs[workflow_id, run_id]
        handle = self.temporal.get_workflow_handle(workflow_id, run_id=run_id)
        try:
            async for event in handle.fetch_history_events(page_size=1):
                started = event.workflow_execution_started_event_attributes
                break
            else:
                return None
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return None
        (job,) = await self.temporal.data_converter.decode(started.input.payloads, [JobInput])
        record: JobRecord | None = job.record
        # None for the first run, one of a run that keeps nothing it folds, or one that nothing was folded before.
        kept = record is not None and record.protocol >= 4 and summarised_record(record)
        given = _Given(record.folded if record is not None and kept else None, started.continued_execution_run_id)
        self._inputs[workflow_id, run_id] = given
        return given

    async def result(self, namespace: str, name: str) -> Status:
        """Wait until the run ends; its final Status (Completed, Failed, Cancelled, or Terminated)."""
        await self._served(namespace, name)
        try:
            status = await run_result(self._handle(namespace, name))
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                raise NotFound(f"no run named {name} in namespace {namespace}") from None
            raise
        await self._served(namespace, name)  # deleted while it was awaited
        return status

    async def follow(self, namespace: str, name: str, poll_seconds: float = 0.5) -> AsyncIterator[Event]:
        """Every event, then new ones as they come, until the run's workflow closes."""
        seen = 0
        handle = self._handle(namespace, name)
        while True:
            try:
                info = await handle.describe()
                closed = info.status != WorkflowExecutionStatus.RUNNING
            except RPCError as error:
                if error.status == RPCStatusCode.NOT_FOUND:
                    raise NotFound(f"no run named {name} in namespace {namespace}") from None
                raise
            stream = await self.events(namespace, name)
            for event in stream[seen:]:
                yield event
            seen = len(stream)
            if closed:
                return
            await asyncio.sleep(poll_seconds)

    async def cancel(self, namespace: str, name: str) -> Status:
        return await self._update(namespace, name, contracts.CANCEL)

    async def stop(self, namespace: str, name: str, task_id: str, reason: str | None = None) -> Status:
        return await self._update(
            namespace, name, contracts.REQUEST_STOP, StopTaskRequest(task_id=task_id, reason=reason)
        )

    async def _update(self, namespace: str, name: str, update: contracts.Update[In, Status], *args: In) -> Status:
        handle = self._handle(namespace, name)
        try:
            return await contracts.update(handle, update, *args)
        except WorkflowUpdateFailedError as error:
            cause = error.cause
            if isinstance(cause, ApplicationError) and cause.type == "UnknownTask":  # no such worker: exit 3, 404
                raise NotFound(cause.message) from None
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
        task = await self._task(namespace, name, task_id)
        if task.node is None:
            raise AstraeusError(f"worker {task_id} of run {name} is on no machine now ({task.status.state})")
        return await self._read_log(namespace, name, task, task.node, lines, max_bytes)

    async def follow_logs(
        self, namespace: str, name: str, task_id: str, poll_seconds: float = 1.0
    ) -> AsyncIterator[str]:
        """A worker's output, then what it writes next, until the worker ended for good (a worker that restarts:
        each attempt's output in turn). Each read is a short LogsWorkflow on its machine."""
        attempt, shown = None, ""
        while True:
            task = await self._task(namespace, name, task_id)
            over = task.status.state in TASK_ENDED and task.restart_at is None
            if task.node is not None:
                if task.attempt != attempt:
                    attempt, shown = task.attempt, ""
                text = await self._read_log(namespace, name, task, task.node, 100_000, 1 << 20)
                yield new_output(shown, text)
                shown = text
            if over:
                return
            await asyncio.sleep(poll_seconds)

    async def _task(self, namespace: str, name: str, task_id: str) -> TaskView:
        described = await self.describe(namespace, name)
        task = next((t for t in described.tasks if t.id == task_id), None)
        if task is None:
            raise NotFound(f"run {namespace}/{name} has no worker {task_id}")
        return task

    async def _read_log(self, namespace: str, name: str, task: TaskView, node: str, lines: int, max_bytes: int) -> str:
        ref = TaskRef(namespace=namespace, job=name, task_id=task.id, attempt=task.attempt)
        read = ReadLogInput(ref=ref, lines=lines, max_bytes=max_bytes)
        request = LogsInput(node=node, read=read)
        try:
            result = await self.temporal.execute_workflow(
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

    async def interactive_token(
        self, namespace: str, name: str, task_id: str, ttl_seconds: int = 3600
    ) -> tuple[str, datetime]:
        """A new token for the worker's current attempt, and when it expires: made here, its public key granted
        by the worker's machine (the token itself never leaves this process)."""
        task = await self._session_task(namespace, name, task_id)
        token = session_token.new_token()
        ref = TaskRef(namespace=namespace, job=name, task_id=task.id, attempt=task.attempt)
        grant = GrantSessionInput(ref=ref, public_key=session_token.public_key(token), ttl_seconds=ttl_seconds)
        answer = await self._session(namespace, name, task, SessionInput(node=task.node or "", grant=grant))
        assert answer.granted is not None
        return token, answer.granted.expires_at

    async def attach(
        self, namespace: str, name: str, task_id: str, token: str, argv: list[str], stdin: str = "",
        timeout_seconds: float = 60,
    ) -> Attached:  # fmt: skip
        """Run `argv` in the worker's current attempt with `stdin` as its input, as the holder of `token`."""
        task = await self._session_task(namespace, name, task_id)
        ref = TaskRef(namespace=namespace, job=name, task_id=task.id, attempt=task.attempt)
        request = AttachInput(
            ref=ref, argv=argv, stdin=stdin, timeout_seconds=timeout_seconds, nonce=uuid.uuid4().hex,
            signed_at=datetime.now(UTC),
        )  # fmt: skip
        try:
            signed = session_token.sign(token, request)
        except session_token.BadToken as err:
            raise SessionRefused(f"token refused: {err}") from None
        answer = await self._session(namespace, name, task, SessionInput(node=task.node or "", attach=signed))
        assert answer.attached is not None
        return answer.attached

    async def _session_task(self, namespace: str, name: str, task_id: str) -> TaskView:
        task = await self._task(namespace, name, task_id)
        if task.node is None or task.status.state not in ("Running", "Stale"):
            raise AstraeusError(f"worker {task_id} of run {name} is not running ({task.status.state})")
        return task

    async def _session(self, namespace: str, name: str, task: TaskView, request: SessionInput) -> SessionOutput:
        timeout = request.answer_within_seconds + (request.attach.timeout_seconds if request.attach else 0)
        try:
            return await self.temporal.execute_workflow(
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

    async def ls(
        self,
        namespace: str | None = None,
        state: str | None = None,
        *,
        limit: int = 100,
        page: str | None = None,
        include_deleted: bool = False,
    ) -> RunPage:
        """Runs, newest first, filtered by namespace and state, `limit` at most, from one visibility query (search
        attributes and memo); `page` is the token a previous page gave. A run whose workflow was terminated is
        Terminated, whatever state it last recorded (its AstraeusState stays that one). Deleted runs are left out;
        with `include_deleted` they follow on the last page, as Deleted (state Deleted: only they)."""
        if state == DELETED:
            if not include_deleted:
                raise AstraeusError(f"state {DELETED}: only with include_deleted")
            runs = [deleted_summary(t) for t in await tombstones(self.temporal, namespace)]
            return RunPage(runs=runs[:limit])
        listed, run_ids = await self._listed(namespace, state, limit, page)
        gone = {t.run_id for t in await tombstones(self.temporal, namespace)} if listed.runs else set()
        runs = [r for r, run_id in zip(listed.runs, run_ids, strict=True) if run_id not in gone]
        if include_deleted and listed.next_page is None and state is None:
            runs += [deleted_summary(t) for t in await tombstones(self.temporal, namespace)]
        return RunPage(runs=runs, next_page=listed.next_page)

    async def _listed(
        self, namespace: str | None, state: str | None, limit: int, page: str | None
    ) -> tuple[RunPage, list[str]]:
        """A page of runs as visibility lists them (deleted ones among them), and each one's workflow run id."""
        query = f'WorkflowType="{contracts.JOB_WORKFLOW}"'
        if namespace:
            query += f' AND {SA_NAMESPACE}="{_quote(namespace)}"'
        if state == TERMINATED:
            query += ' AND ExecutionStatus="Terminated"'
        elif state:
            query += f' AND {SA_STATE}="{_quote(state)}" AND ExecutionStatus!="Terminated"'
        try:
            token = base64.urlsafe_b64decode(page) if page else None
        except ValueError:
            raise AstraeusError(f"--page {page}: not a page token that ls printed") from None
        listed = self.temporal.list_workflows(query, page_size=limit, next_page_token=token)
        try:
            await listed.fetch_next_page(page_size=limit)
        except RPCError as error:
            if page and error.status != RPCStatusCode.UNAVAILABLE:  # the server cannot read it (INTERNAL here)
                raise AstraeusError(f"--page {page}: not a page token that ls printed") from None
            raise
        runs = [await summary(wf) for wf in listed.current_page or []]
        run_ids = [wf.run_id or "" for wf in listed.current_page or []]
        after = listed.next_page_token
        return RunPage(runs=runs, next_page=base64.urlsafe_b64encode(after).decode() if after else None), run_ids

    async def nodes(self) -> list[NodeView]:
        views = []
        async for wf in self.temporal.list_workflows(contracts.OPEN_NODES):
            views.append(await contracts.query(self.temporal.get_workflow_handle(wf.id), contracts.VIEW))
        return sorted(views, key=lambda v: v.name)

    async def usage(self) -> ClusterUse:
        """Each machine's free room and each workspace's use, from what every open run's placed workers hold: read
        as the scheduler reads it when it rebuilds its view (a query of each open run, so it costs one per run)."""
        placed: list[Allocation] = []
        async for wf in self.temporal.list_workflows(contracts.OPEN_JOBS):
            try:
                seen = await contracts.query(self.temporal.get_workflow_handle(wf.id), contracts.SCHEDULER_VIEW)
            except (RPCError, WorkflowQueryFailedError):
                continue  # created a moment ago, or ended since it was listed: it holds nothing to count
            placed.extend(seen.placed)
        return cluster_use(await self.nodes(), placed)

    async def drives(self) -> list[Drive]:
        """The catalogue of drives (`astraeus drive ls`); none before the first is made. Changing it is an admin's:
        `workers.admin.create_drive`, `remove_drive` and `set_data_location`."""
        try:
            return await contracts.query(self.temporal.get_workflow_handle(DRIVES_WORKFLOW_ID), contracts.DRIVES)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return []


def new_output(shown: str, text: str) -> str:
    """What `text`, the latest tail of a log, adds to `shown`, the tail read before. A tail is a window that slides
    forward as the log grows: the new one begins at a line of the old one (the earliest that matches, the longest
    overlap), or after it when more than a window was written meanwhile (then all of it is new)."""
    start = 0
    while not text.startswith(shown[start:]):
        start = shown.find("\n", start) + 1 or len(shown)
    return text[len(shown) - start :]


def _quote(value: str) -> str:
    if '"' in value or "\\" in value:
        raise AstraeusError(f"filter value {value!r} may not contain quotes or backslashes")
    return value
