"""Admin verbs of the Python client and the CLI: namespace quotas (`astraeus quota set|rm|ls`) and machines
(`astraeus nodes cordon|uncordon|remove`)."""

from __future__ import annotations

from typing import Any

from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from workers.client import AstraeusError, NotFound
from workflows.domain.nodes import NodeView, node_id
from workflows.domain.quotas import Quota
from workflows.messages import CONTROL_TASK_QUEUE, QUOTAS_WORKFLOW_ID, CordonRequest, QuotasInput, RemoveQuotaRequest
from workflows.quotas import QuotasWorkflow


async def _update(handle: WorkflowHandle[Any, Any], update: str, args: list[Any], result_type: type[Any]) -> Any:
    try:
        return await handle.execute_update(update, args=args, result_type=result_type)
    except WorkflowUpdateFailedError as error:
        cause = error.cause
        raise AstraeusError(cause.message if isinstance(cause, ApplicationError) else str(cause)) from None


async def set_quota(client: Client, quota: Quota) -> list[Quota]:
    """Set a namespace's quota (replacing the one it had); returns every quota."""
    handle = await client.start_workflow(
        QuotasWorkflow.run,
        QuotasInput(),
        id=QUOTAS_WORKFLOW_ID,
        task_queue=CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary="namespace quotas",
    )
    return await _update(handle, "set_quota", [quota], list[Quota])  # type: ignore[no-any-return]


async def remove_quota(client: Client, namespace: str) -> list[Quota]:
    handle = client.get_workflow_handle(QUOTAS_WORKFLOW_ID)
    try:
        return await _update(handle, "remove_quota", [RemoveQuotaRequest(namespace=namespace)], list[Quota])  # type: ignore[no-any-return]
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        raise NotFound(f"namespace {namespace} has no quota") from None


async def quotas(client: Client) -> list[Quota]:
    try:
        handle = client.get_workflow_handle(QUOTAS_WORKFLOW_ID)
        return await handle.query("quotas", result_type=list[Quota])  # type: ignore[no-any-return]
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        return []


async def node_verb(client: Client, name: str, verb: str, reason: str | None = None) -> NodeView:
    """`cordon`, `uncordon` or `remove` one machine."""
    handle = client.get_workflow_handle(node_id(name))
    args: list[Any] = [] if verb == "uncordon" else [CordonRequest(reason=reason or "")]
    try:
        return await _update(handle, verb, args, NodeView)  # type: ignore[no-any-return]
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        raise NotFound(f"no machine named {name}") from None


def render_quotas(listed: list[Quota]) -> str:
    if not listed:
        return "no quotas are set"
    rows: list[tuple[str, ...]] = [("NAMESPACE", "GPUS", "CPU", "MEMORY_BYTES", "POOLS")]
    for q in listed:
        limits = (q.gpus, q.cpu, q.memory_bytes)
        rows.append((q.namespace, *("-" if v is None else f"{v:g}" for v in limits), ",".join(q.pools) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
