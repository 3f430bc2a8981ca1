"""The control plane's part of deleting a run: end it, then forget it (DeleteRunWorkflow's first and last steps),
and what every client asks before it serves a run whose workflow closed: whether that run was deleted."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import datetime

from temporalio import activity
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from workflows import contracts
from workflows.contracts import (
    DELETED_RUNS_WORKFLOW_ID,
    OPEN_NODES,
    identity_id_prefix,
    job_id,
    logs_id_prefix,
    session_id_prefix,
)
from workflows.domain.inventory import NodeState
from workflows.domain.run.views import TERMINATED
from workflows.domain.tombstones import Tombstone
from workflows.messages import DeletedRunsInput, EndedRun, EndRunInput, ForgetRunInput, TombstonesQuery

NO_SUCH_RUN = "NoSuchRun"


async def tombstones(
    client: Client, namespace: str | None = None, runs: list[tuple[str, str]] | None = None
) -> list[Tombstone]:
    """The tombstones of a namespace (None: all), of these runs when given; none while no run was ever deleted."""
    handle = client.get_workflow_handle(DELETED_RUNS_WORKFLOW_ID)
    try:
        return await contracts.query(handle, contracts.TOMBSTONES, TombstonesQuery(namespace=namespace, runs=runs))
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        return []


async def deleted(client: Client, namespace: str, name: str, run_id: str) -> Tombstone | None:
    """The tombstone of workflow run `run_id` of run `namespace/name`, when it was deleted: Temporal removes a
    workflow some time after it is asked to (half a minute on the dev server), and it is no longer served meanwhile."""
    found = await tombstones(client, namespace, [(namespace, name)])
    return next((t for t in found if t.run_id == run_id), None)


async def end_run(client: Client, input: EndRunInput) -> EndedRun:
    """Cancel the run for its delete (update `delete`) unless it ended, and wait until its workflow closed; what it
    ended as, and the machines that may hold its files."""
    run = f"{input.namespace}/{input.name}"
    handle = client.get_workflow_handle(job_id(input.namespace, input.name))
    try:
        info = await handle.describe()
    except RPCError as error:
        if error.status == RPCStatusCode.NOT_FOUND:
            raise ApplicationError(f"no run named {input.name} in namespace {input.namespace}", type=NO_SUCH_RUN,
                                   non_retryable=True) from None  # fmt: skip
        raise
    if info.status != WorkflowExecutionStatus.RUNNING and await deleted(client, *_names(input), info.run_id):
        raise ApplicationError(f"run {run} was deleted already", type=NO_SUCH_RUN, non_retryable=True)
    if info.status == WorkflowExecutionStatus.RUNNING:
        with contextlib.suppress(WorkflowUpdateFailedError, RPCError):  # it closed meanwhile: nothing to cancel
            try:
                await contracts.update(handle, contracts.DELETE)
            except WorkflowUpdateFailedError:  # a control plane from before `delete`: a plain cancel, then
                await contracts.update(handle, contracts.CANCEL)
    while (latest := await handle.describe()).status == WorkflowExecutionStatus.RUNNING:
        activity.heartbeat()
        await asyncio.sleep(0.5)
    status = await contracts.query(client.get_workflow_handle(latest.id, run_id=latest.run_id), contracts.STATUS)
    state = TERMINATED if latest.status == WorkflowExecutionStatus.TERMINATED else str(status.state)
    memo = await latest.memo()
    created = datetime.fromisoformat(memo["created_at"]) if "created_at" in memo else latest.start_time
    return EndedRun(run_id=latest.run_id, state=state, reason=status.reason, created_at=created,
                    machines=await _machines_up(client))  # fmt: skip


async def forget_run(client: Client, input: ForgetRunInput) -> None:
    """Remove the deleted run's workflow runs and its logs', sessions' and identities' workflows from Temporal, then
    keep its tombstone (from then on no client serves the run, and its name may be used again). Idempotent."""
    t = input.tombstone
    await _remove(client, job_id(t.namespace, t.name), t.run_id)
    query = f'WorkflowId="{job_id(t.namespace, t.name)}" AND ExecutionStatus!="Running"'
    async for wf in client.list_workflows(query):  # the runs it continued as new from
        await _remove(client, wf.id, wf.run_id)
    prefixes = [f(t.namespace, t.name) for f in (logs_id_prefix, session_id_prefix, identity_id_prefix)]
    for prefix in prefixes:  # their output, the commands people ran, the certificates issued
        async for wf in client.list_workflows(f'WorkflowId STARTS_WITH "{prefix}"'):
            await _remove(client, wf.id, wf.run_id)
    handle = await contracts.singleton(
        client, contracts.DELETED_RUNS_WORKFLOW, DeletedRunsInput(), DELETED_RUNS_WORKFLOW_ID, "deleted runs"
    )
    await contracts.update(handle, contracts.ADD_TOMBSTONE, t)


def _names(input: EndRunInput) -> tuple[str, str]:
    return input.namespace, input.name


async def _remove(client: Client, workflow_id: str, run_id: str | None) -> None:
    request = DeleteWorkflowExecutionRequest(
        namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id or "")
    )
    try:
        await client.workflow_service.delete_workflow_execution(request)
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:  # removed already
            raise


async def _machines_up(client: Client) -> list[str]:
    names = []
    async for wf in client.list_workflows(OPEN_NODES):
        with contextlib.suppress(RPCError):
            view = await contracts.query(client.get_workflow_handle(wf.id), contracts.VIEW)
            if view.state is NodeState.READY:
                names.append(view.name)
    return sorted(names)
