"""`ls`: runs as the visibility store lists them (search attributes and memo, never by asking a run), and deleted
runs from their tombstones."""

from __future__ import annotations

import base64
from datetime import datetime
from typing import Any

from pydantic import BaseModel
from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from workers.errors import AstraeusError
from workflows import contracts
from workflows.contracts import PRIORITY_KEY, SA_NAMESPACE, SA_STATE, STATE_KEY
from workflows.domain.run.views import TERMINATED
from workflows.domain.spec import JobSpec
from workflows.domain.tombstones import DELETED, Tombstone


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


def _quote(value: str) -> str:
    if '"' in value or "\\" in value:
        raise AstraeusError(f"filter value {value!r} may not contain quotes or backslashes")
    return value


async def list_runs(
    temporal: Client, namespace: str | None, state: str | None, limit: int, page: str | None
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
    listed = temporal.list_workflows(query, page_size=limit, next_page_token=token)
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
