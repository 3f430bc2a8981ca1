"""Admin verbs of the Python client and the CLI: namespace quotas (`astraeus quota set|rm|ls`), machines
(`astraeus nodes cordon|uncordon|remove|data-location`), the catalogue of drives (`astraeus drive create|ls|rm`)
and the HTTP API's tokens (`astraeus token create|ls|revoke`)."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Any

from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from workers.client import AstraeusClient
from workers.errors import AstraeusError, NotFound
from workflows import contracts
from workflows.contracts import (
    DRIVES_WORKFLOW_ID,
    QUOTAS_WORKFLOW_ID,
    SUBNETS_WORKFLOW_ID,
    TOKENS_WORKFLOW_ID,
    In,
    Out,
    node_id,
)
from workflows.domain.constraints import Drive
from workflows.domain.drives import NewDrive
from workflows.domain.inventory import NodeView
from workflows.domain.scheduling.machines import size_text
from workflows.domain.scheduling.quotas import Quota
from workflows.domain.tokens import Token, digest
from workflows.messages import (
    CordonRequest,
    DataLocationRequest,
    DrivesInput,
    QuotasInput,
    RemoveDriveRequest,
    RemoveQuotaRequest,
    RevokeTokenRequest,
    SubnetRequest,
    TokensInput,
)

TOKEN_PREFIX = "astraeus_"  # a token's secret begins so: a secret scanner (or a person) can tell what it is


async def _update(handle: WorkflowHandle[Any, Any], update: contracts.Update[In, Out], *args: In) -> Out:
    try:
        return await contracts.update(handle, update, *args)
    except WorkflowUpdateFailedError as error:
        cause = error.cause
        if isinstance(cause, ApplicationError) and cause.type in ("NoToken", "NoDrive"):
            raise NotFound(cause.message) from None
        raise AstraeusError(cause.message if isinstance(cause, ApplicationError) else str(cause)) from None


async def set_quota(client: Client, quota: Quota) -> list[Quota]:
    """Set a namespace's quota (replacing the one it had); returns every quota."""
    handle = await contracts.singleton(
        client, contracts.QUOTAS_WORKFLOW, QuotasInput(), QUOTAS_WORKFLOW_ID, "namespace quotas"
    )
    return await _update(handle, contracts.SET_QUOTA, quota)


async def remove_quota(client: Client, namespace: str) -> list[Quota]:
    handle = client.get_workflow_handle(QUOTAS_WORKFLOW_ID)
    try:
        return await _update(handle, contracts.REMOVE_QUOTA, RemoveQuotaRequest(namespace=namespace))
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        raise NotFound(f"namespace {namespace} has no quota") from None


async def quotas(client: Client) -> list[Quota]:
    try:
        handle = client.get_workflow_handle(QUOTAS_WORKFLOW_ID)
        return await contracts.query(handle, contracts.QUOTAS)
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        return []


async def node_verb(client: Client, name: str, verb: str, reason: str | None = None) -> NodeView:
    """`cordon`, `uncordon` or `remove` one machine."""
    handle = client.get_workflow_handle(node_id(name))
    try:
        if verb == "uncordon":
            return await _update(handle, contracts.UNCORDON)
        request = CordonRequest(reason=reason or "")
        view = await _update(handle, {"cordon": contracts.CORDON, "remove": contracts.REMOVE}[verb], request)
        if verb == "remove":
            await free_subnet(client, name)
        return view
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        raise NotFound(f"no machine named {name}") from None


async def free_subnet(client: Client, name: str) -> None:
    """A removed machine's subnet of the node network goes back to the range (none before any was assigned)."""
    try:
        await _update(client.get_workflow_handle(SUBNETS_WORKFLOW_ID), contracts.FREE_SUBNET, SubnetRequest(node=name))
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise


async def set_data_location(client: Client, name: str, path: str) -> NodeView:
    """Choose where machine `name` keeps copies of drives; its agent must find the directory there."""
    handle = client.get_workflow_handle(node_id(name))
    try:
        return await _update(handle, contracts.SET_DATA_LOCATION, DataLocationRequest(path=path))
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        raise NotFound(f"no machine named {name}") from None


async def create_drive(client: Client, new: NewDrive) -> list[Drive]:
    """Add a drive to the catalogue; returns every drive."""
    handle = await contracts.singleton(
        client, contracts.DRIVES_WORKFLOW, DrivesInput(), DRIVES_WORKFLOW_ID, "the catalogue of drives"
    )
    return await _update(handle, contracts.CREATE_DRIVE, new)


async def remove_drive(client: Client, name: str) -> list[Drive]:
    """Remove a drive no run uses (refused, naming the runs, while some do); machines keep their copies."""
    handle = client.get_workflow_handle(DRIVES_WORKFLOW_ID)
    try:
        return await _update(handle, contracts.REMOVE_DRIVE, RemoveDriveRequest(name=name))
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        raise NotFound(f"no drive named {name}") from None


async def drives(client: Client) -> list[Drive]:
    """Every drive of the catalogue; none before the first is made."""
    return await AstraeusClient(client).drives()


def render_drives(listed: list[Drive]) -> str:
    if not listed:
        return "no drives: astraeus drive create NAME --machine MACHINE --size SIZE --source DIR [--site SITE]"
    rows: list[tuple[str, ...]] = [("DRIVE", "SITE", "MACHINE", "SIZE", "SOURCE", "PROBLEM")]
    for d in listed:
        rows.append((d.name, d.site or "-", d.node or "-", size_text(d.size_bytes), d.source, d.problem or "-"))
    return _table(rows)


def render_data(view: NodeView) -> str:
    """A machine's data location, its room and its copies of drives."""
    inv = view.inventory
    if inv is None or inv.data_location is None:
        return f"{view.name}: no data location (astraeus nodes data-location {view.name} PATH)"
    free = "-" if inv.data_free_bytes is None else size_text(inv.data_free_bytes)
    lines = [f"{view.name}: data location {inv.data_location}, {free} free"]
    rows: list[tuple[str, ...]] = [("DRIVE", "SIZE", "FILLED", "PATH")]
    for copy in inv.drive_copies:
        filled = copy.filled_at.strftime("%Y-%m-%d %H:%M:%S UTC") if copy.filled_at else "-"
        rows.append((copy.drive, size_text(copy.size_bytes), filled, copy.path))
    lines.append(_table(rows) if inv.drive_copies else "no copies of drives")
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


async def create_token(client: Client, namespace: str | None, note: str = "") -> tuple[str, Token]:
    """A new token for the workspace `namespace` (None: an admin token): its secret, shown once and kept nowhere,
    and what is kept of it."""
    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = Token(id=f"tok-{secrets.token_hex(4)}", namespace=namespace, sha256=digest(secret),
                  created_at=datetime.now(UTC), note=note)  # fmt: skip
    handle = await contracts.singleton(
        client, contracts.TOKENS_WORKFLOW, TokensInput(), TOKENS_WORKFLOW_ID, "API tokens"
    )
    await _update(handle, contracts.ADD_TOKEN, token)
    return secret, token


async def revoke_token(client: Client, token_id: str) -> list[Token]:
    handle = client.get_workflow_handle(TOKENS_WORKFLOW_ID)
    try:
        return await _update(handle, contracts.REVOKE_TOKEN, RevokeTokenRequest(id=token_id))
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        raise NotFound(f"no token {token_id}") from None


async def tokens(client: Client) -> list[Token]:
    """Every token (their digests); none before the first is made."""
    try:
        return await contracts.query(client.get_workflow_handle(TOKENS_WORKFLOW_ID), contracts.TOKENS)
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        return []


def render_tokens(listed: list[Token]) -> str:
    if not listed:
        return "no tokens: astraeus token create NAMESPACE (or --admin)"
    rows = [("ID", "WORKSPACE", "CREATED", "NOTE")]
    for t in listed:
        rows.append((t.id, t.namespace or "(admin)", t.created_at.strftime("%Y-%m-%d %H:%M:%S UTC"), t.note or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def render_quotas(listed: list[Quota]) -> str:
    if not listed:
        return "no quotas are set"
    rows: list[tuple[str, ...]] = [("NAMESPACE", "GPUS", "CPU", "MEMORY_BYTES", "POOLS")]
    for q in listed:
        limits = (q.gpus, q.cpu, q.memory_bytes)
        rows.append((q.namespace, *("-" if v is None else f"{v:g}" for v in limits), ",".join(q.pools) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)
