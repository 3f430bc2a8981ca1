"""Activities of the control plane itself."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol

from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities import deletion
from activities.identity import ClusterCA, IdentityRefused, spiffe_id
from workflows import contracts
from workflows.contracts import SA_NODES, implements
from workflows.domain.run.events import MachineLost
from workflows.domain.run.job import first_requests
from workflows.domain.settings import Settings
from workflows.domain.spec import job_id
from workflows.messages import (
    PROTOCOL,
    AttemptsQuery,
    CancelRunInput,
    EndedRun,
    EndRunInput,
    ForgetRunInput,
    IssuedIdentity,
    IssueIdentityInput,
    LoadSettingsInput,
    LoadSettingsResult,
    PlaceInput,
    PlaceResult,
)

DEFAULT_CA_DIR = Path(".astraeus/ca")

log = logging.getLogger(__name__)


class Placing(Protocol):
    """What asks the scheduler: the control plane's link to it (activities/scheduler_link.py)."""

    def place(self, input: PlaceInput) -> Awaitable[PlaceResult]: ...


class ControlActivities:
    def __init__(
        self, settings: Settings, client: Client, ca_dir: Path = DEFAULT_CA_DIR, scheduler: Placing | None = None
    ) -> None:
        self._settings = settings
        self._client = client
        self._ca = ClusterCA(ca_dir)
        self._scheduler = scheduler  # where a new run's first requests go (the scheduler link), if anywhere

    @implements(contracts.issue_identity)
    async def issue_identity(self, input: IssueIdentityInput) -> IssuedIdentity:
        """Sign the attempt's certificate request, once its run says it has that attempt on that machine. Refused
        (not retried: the machine asks again) when it has not, or the request names another identity."""
        ref = input.ref
        handle = self._client.get_workflow_handle(job_id(ref.namespace, ref.job))
        try:
            held = await contracts.query(handle, contracts.ATTEMPTS_ON, AttemptsQuery(node=input.node))
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            held = None
        if held is None or not held.open or held.attempts.get(ref.task_id) != ref.attempt:
            why = f"run {ref.namespace}/{ref.job} has no attempt {ref.attempt} of {ref.task_id} on {input.node}"
            raise ApplicationError(why, type="IdentityRefused", non_retryable=True)
        identity = spiffe_id(ref.namespace, ref.job, ref.task_id, ref.attempt)
        ttl = timedelta(seconds=self._settings.identity_ttl_seconds)
        try:
            cert = await asyncio.to_thread(self._ca.sign, input.csr_pem.encode(), identity, ttl, datetime.now(UTC))
            bundle = await asyncio.to_thread(self._ca.certificate_pem)
        except IdentityRefused as refused:
            raise ApplicationError(str(refused), type="IdentityRefused", non_retryable=True) from None
        except OSError as error:
            raise ApplicationError(f"the cluster CA cannot sign: {error}", type="CaUnavailable") from None
        return IssuedIdentity(cert_pem=cert.decode(), bundle_pem=bundle.decode())

    @implements(contracts.load_settings)
    async def load_settings(self, input: LoadSettingsInput | None = None) -> LoadSettingsResult:
        """The operator's settings and this version's protocol, recorded in each run's history when it starts (so
        replay sees the same). Given a new run, the time its first decision is taken (`at`, as asked), and that
        decision's requests, asked of the scheduler here: the run takes the answers instead of asking itself. A spec
        that cannot be decided asks nothing (the run's own decision says why), nor does a run whose scheduler does
        not answer: the run is created at once, and its own `place` is tried again until the scheduler is back (a
        request it did receive is answered the same)."""
        loaded = LoadSettingsResult(settings=self._settings, protocol=PROTOCOL, at=input.at if input else None)
        if input is None or self._scheduler is None:
            return loaded
        try:
            requests = first_requests(input.spec, self._settings, PROTOCOL, input.at)
        except Exception:
            log.exception("cannot decide run %s/%s's first requests", input.spec.namespace, input.spec.name)
            return loaded
        if not requests:
            return loaded
        try:
            placed = await self._scheduler.place(PlaceInput(requests=requests))
        except Exception as error:
            log.warning("run %s/%s places its first workers itself: %s", input.spec.namespace, input.spec.name, error)
            return loaded
        return loaded.model_copy(update={"requests": requests, "answers": placed.answers})

    @implements(contracts.tell_runs_machine_lost)
    async def tell_runs_machine_lost(self, report: MachineLost) -> int:
        """Tell every open run with a worker on the machine (search attribute AstraeusNodes) that it is gone."""
        told = 0
        query = f'{contracts.OPEN_JOBS} AND {SA_NODES}="{report.node}"'
        async for run in self._client.list_workflows(query):
            try:
                await contracts.signal(self._client.get_workflow_handle(run.id), contracts.MACHINE_LOST, report)
                told += 1
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:  # it closed meanwhile: nothing left to tell
                    raise
        return told

    @implements(contracts.cancel_run_workflow)
    async def cancel_run_workflow(self, input: CancelRunInput) -> None:
        """Ask Temporal to cancel a run's workflow whose run ended Cancelled: the SDK closes a workflow Canceled only
        after such a request, and a workflow may not ask it of itself. Asking twice is harmless."""
        handle = self._client.get_workflow_handle(input.workflow_id, run_id=input.run_id)
        try:
            await handle.cancel(reason=input.reason)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:  # it closed meanwhile: nothing left to cancel
                raise

    @implements(contracts.end_run)
    async def end_run(self, input: EndRunInput) -> EndedRun:
        """A run being deleted: cancelled (workers stopped with "Run deleted") and its workflow closed."""
        return await deletion.end_run(self._client, input)

    @implements(contracts.forget_run)
    async def forget_run(self, input: ForgetRunInput) -> None:
        """A deleted run's tombstone kept; its workflow runs and logs' workflows removed from Temporal."""
        await deletion.forget_run(self._client, input)
