"""A machine's side of worker identities: each attempt that asks `identity: true` gets a key made here and a
certificate issued by the cluster CA (an IdentityWorkflow on the control plane), kept in
`<agent data dir>/identity/<attempt>/`, given to the worker as files, and renewed at half its life while it runs."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import ActivityError, FailureError
from temporalio.exceptions import TimeoutError as TemporalTimeout
from temporalio.service import RPCError

from activities.agent.runtime.base import Mount, forget_attempts
from activities.identity import AttemptIdentity, spiffe_id
from workflows import contracts
from workflows.contracts import CONTROL_TASK_QUEUE
from workflows.domain.reasons import R, Reason, error_text
from workflows.domain.refs import TaskRef
from workflows.identity import IdentityWorkflow
from workflows.messages import IssueIdentityInput

log = logging.getLogger(__name__)

IN_CONTAINER = "/var/run/astraeus/identity"  # where a container sees its identity's files
ANSWER_WITHIN = timedelta(seconds=20)  # an issue that takes longer is asked again; the worker waits meanwhile


class Identities:
    def __init__(self, client: Client, data_dir: Path, node: str, answer_within: timedelta = ANSWER_WITHIN) -> None:
        self._client = client
        self.root = data_dir / "identity"
        self._node = node
        self._answer_within = answer_within

    def directory(self, key: TaskRef) -> Path:
        return self.root / key.slug

    async def ensure(self, key: TaskRef) -> Reason | None:
        """None once the attempt holds a certificate that does not need renewing yet; else it is asked for, and
        while none is held, why the worker waits ("Waiting for the worker's identity: <why>")."""
        attempt = AttemptIdentity(self.directory(key))
        held = attempt.validity()
        if held is not None and datetime.now(UTC) < held.renew_after():
            return None
        why = await self._issue(key, attempt)
        if why is None:
            return None
        if held is not None and datetime.now(UTC) < held.ends:
            log.warning("%s: its certificate was not renewed (%s): tried again later", key.slug, why)
            return None
        return R.WaitingForIdentity(why=why)

    def held(self) -> bool:
        """Whether any attempt here has an identity (else there is nothing to renew, and no need to look)."""
        return self.root.is_dir() and any(self.root.iterdir())

    async def renew(self, running: Iterable[TaskRef]) -> None:
        """Renew the certificates of the running attempts that have one and are past half its life."""
        for key in running:
            if self.directory(key).is_dir():
                await self.ensure(key)

    def files(self, key: TaskRef, in_container: bool) -> tuple[dict[str, str], list[Mount]]:
        """What the launch gets: the variables naming the files, and, in a container, the directory mounted
        read-only (a process reads them where they are)."""
        attempt = AttemptIdentity(self.directory(key))
        if not in_container:
            return attempt.files(str(attempt.directory)), []
        mount = Mount(target=IN_CONTAINER, source=str(attempt.directory), kind="bind", read_only=True)
        return attempt.files(IN_CONTAINER), [mount]

    def forget(self, keep: Iterable[str]) -> None:
        """Remove the identities of every attempt but those in `keep` (slugs)."""
        forget_attempts(self.root, keep)

    async def _issue(self, key: TaskRef, attempt: AttemptIdentity) -> str | None:
        """Ask the cluster CA for the attempt's certificate and keep it; None once kept, else why not."""
        identity = spiffe_id(key.namespace, key.job, key.task_id, key.attempt)
        try:
            csr = await asyncio.to_thread(attempt.request, identity)
        except OSError as error:
            return f"cannot write its key on this machine: {error_text(error)}"
        ref = TaskRef(namespace=key.namespace, job=key.job, task_id=key.task_id, attempt=key.attempt)
        request = IssueIdentityInput(ref=ref, node=self._node, csr_pem=csr.decode())
        serial = uuid.uuid4().hex[:12]
        try:
            issued = await self._client.execute_workflow(
                IdentityWorkflow.run,
                request,
                id=contracts.identity_id(key.namespace, key.job, key.task_id, key.attempt, serial),
                task_queue=CONTROL_TASK_QUEUE,
                execution_timeout=self._answer_within,
            )
        except WorkflowFailureError as error:
            cause = error.cause.cause if isinstance(error.cause, ActivityError) else error.cause
            if isinstance(cause, TemporalTimeout) or cause is None:
                return f"the cluster CA did not answer within {self._answer_within.total_seconds():g} s"
            return f"the cluster CA did not issue it: {cause.message if isinstance(cause, FailureError) else cause}"
        except RPCError as error:
            return f"the control plane cannot be reached: {error}"
        try:
            await asyncio.to_thread(attempt.keep, issued.cert_pem.encode(), issued.bundle_pem.encode())
        except OSError as error:
            return f"cannot write its certificate on this machine: {error_text(error)}"
        return None
