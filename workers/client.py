"""The Python client: the same verbs as the CLI (submit, ls, status, describe, events, cancel, stop, nodes)."""

from __future__ import annotations

import asyncio
import gc
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import SearchAttributeKey, SearchAttributePair, WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import ActivityError, ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities import session_token
from activities.deletion import deleted, tombstones
from workers.errors import AstraeusError, NotFound, SessionRefused
from workers.folds import Inputs, folds_of
from workers.listing import RunPage, deleted_summary, list_runs, run_memo
from workers.outcomes import ASK_AGAIN_SECONDS, Terminated, run_result, termination
from workers.worker_io import ask_session, new_output, read_log
from workflows import contracts
from workflows.contracts import CONTROL_TASK_QUEUE, DRIVES_WORKFLOW_ID, In, Out, search_attributes
from workflows.deletion import DeleteRunWorkflow
from workflows.domain.constraints import Drive
from workflows.domain.inventory import NodeView
from workflows.domain.refs import TaskRef
from workflows.domain.requests import Allocation
from workflows.domain.run.status import TASK_ENDED, RunState, Status
from workflows.domain.run.views import (
    Event,
    JobDescription,
    TaskView,
    page,
    paged,
    summarised,
    terminated_description,
    terminated_events,
    terminated_status,
    unfolded,
)
from workflows.domain.run.views import events as events_of
from workflows.domain.scheduling.use import ClusterUse, cluster_use
from workflows.domain.spec import JobSpec, job_id
from workflows.domain.tombstones import DELETED, Tombstone
from workflows.job import JobWorkflow
from workflows.messages import (
    Attached,
    AttachInput,
    DeleteRunInput,
    GrantSessionInput,
    JobInput,
    SessionInput,
    StopTaskRequest,
)

CREATING_SECONDS = 60.0  # how long a read waits for a run just submitted to make its record
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


class AstraeusClient:
    """Astraeus's verbs over a Temporal client. Use it as `async with AstraeusClient(...) as client:` (or call
    `close`) in a script, so that the process ends cleanly. `control_build`: the build of the control plane's worker
    serving on this client in this process (`Embedded.control_build`), listed on each run at its start
    (BUILD_IDS_KEY); None elsewhere (the CLI, `astraeus api` apart)."""

    def __init__(self, client: Client, control_build: str | None = None) -> None:
        self.temporal = client
        self.control_build = control_build
        self._inputs: Inputs = {}  # by workflow and run id

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
        return await termination(handle, described.close_time)

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
        ones): the entries folded are put back from the runs of the workflow that kept them (workers/folds.py)."""
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
            own = await self._ask(latest, namespace, name, contracts.FOLDED)
            folds = await folds_of(self.temporal, self._inputs, latest, own)
            described = described if folds is None else unfolded(described, folds)
        if info.status != WorkflowExecutionStatus.TERMINATED:
            return described, None
        return described, await termination(latest, info.close_time)

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
        return await read_log(self.temporal, namespace, name, task, task.node, lines, max_bytes)

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
                text = await read_log(self.temporal, namespace, name, task, task.node, 100_000, 1 << 20)
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

    async def interactive_token(
        self, namespace: str, name: str, task_id: str, ttl_seconds: int = 3600
    ) -> tuple[str, datetime]:
        """A new token for the worker's current attempt, and when it expires: made here, its public key granted
        by the worker's machine (the token itself never leaves this process)."""
        task = await self._session_task(namespace, name, task_id)
        token = session_token.new_token()
        ref = TaskRef(namespace=namespace, job=name, task_id=task.id, attempt=task.attempt)
        grant = GrantSessionInput(ref=ref, public_key=session_token.public_key(token), ttl_seconds=ttl_seconds)
        answer = await ask_session(
            self.temporal, namespace, name, task, SessionInput(node=task.node or "", grant=grant)
        )
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
        answer = await ask_session(
            self.temporal, namespace, name, task, SessionInput(node=task.node or "", attach=signed)
        )
        assert answer.attached is not None
        return answer.attached

    async def _session_task(self, namespace: str, name: str, task_id: str) -> TaskView:
        task = await self._task(namespace, name, task_id)
        if task.node is None or task.status.state not in ("Running", "Stale"):
            raise AstraeusError(f"worker {task_id} of run {name} is not running ({task.status.state})")
        return task

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
        listed, run_ids = await list_runs(self.temporal, namespace, state, limit, page)
        gone = {t.run_id for t in await tombstones(self.temporal, namespace)} if listed.runs else set()
        runs = [r for r, run_id in zip(listed.runs, run_ids, strict=True) if run_id not in gone]
        if include_deleted and listed.next_page is None and state is None:
            runs += [deleted_summary(t) for t in await tombstones(self.temporal, namespace)]
        return RunPage(runs=runs, next_page=listed.next_page)

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
