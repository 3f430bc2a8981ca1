"""What an agent looks after beside its workers' activities: the attempts an earlier agent process left (adoption),
starts whose attempt its run may no longer have (fencing), workers whose run no longer has them (orphans), the files
of deleted runs, its workers' identities and its node network; and, when its lease is lost, its own workers.

Fencing: a start that may be stale (a retry, one that waited in the queue longer than a lease, one scheduled before
this agent last registered, or one that took that long to set up) asks its run (query `attempts_on`) whether the
attempt is still the run's on this machine, and is refused otherwise; and the lease's holder stops any running
attempt whose run no longer has it, so no worker runs twice. A fresh first start asks nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.agent.identities import Identities
from activities.agent.node_network import NodeNetwork
from activities.agent.runtime.base import Runtime
from activities.agent.starter import Starter
from activities.deletion import tombstones
from workflows import contracts
from workflows.contracts import node_id
from workflows.domain.machine.attempts import Attempts
from workflows.domain.machine.decisions import OrphanStopped
from workflows.domain.reasons import R
from workflows.domain.refs import TaskRef
from workflows.domain.run.events import ExitedWhileLost
from workflows.domain.settings import Settings
from workflows.domain.spec import job_id
from workflows.messages import AttemptsOnNode, AttemptsQuery, DeletedFiles, DeleteRunFilesInput

log = logging.getLogger(__name__)

# How long an exit returned to a run is remembered: should the lease expire meanwhile, it is told to its run again.
RETURNED_KEPT_SECONDS = 600.0
# A run whose workers here are all watched is read (a describe) once every this many looks for orphans: its watches
# send no heartbeat (protocol 7), so none learns that its run was closed (terminated in the Temporal UI, say). A
# watched worker whose end wakes its watch is looked at as seldom (activities/agent/attempts.py).
WATCHED_RUN_LOOKS = 12  # a minute with the default looks (5 s): for 512 runs, 8.5 reads a second


class Housekeeping:
    def __init__(
        self,
        client: Client,
        node_name: str,
        runtime: Runtime,
        starter: Starter,
        attempts: Attempts,
        settings: Settings,
        node_network: NodeNetwork,
        identities: Identities | None = None,
    ) -> None:
        self._client = client
        self.node_name = node_name
        self._runtime = runtime
        self._starter = starter
        self._attempts = attempts
        self._settings = settings
        self.node_network = node_network
        self._identities = identities
        self._identity_renewal: asyncio.Task[None] | None = None  # the renewal of certificates under way
        self._network_look: asyncio.Task[object] | None = None  # making the network, refreshing the mesh's peers
        self._orphan_look: asyncio.Task[None] | None = None  # the look for orphaned workers under way
        self._orphan_look_due = 0.0  # time.monotonic() of the next look
        self._orphans_untold: list[OrphanStopped] = []  # stopped, not yet written in the machine's history
        self._runs_read: dict[tuple[str, str], float] = {}  # time.monotonic() each watched run was last read
        self._doubt_watches = False  # the next look asks the runs of watched attempts too (the lease was taken again)

    def look(self) -> None:
        """At each look of the lease's loop: start what is due (a look for orphans, the renewal of identities, the
        node network), each beside the lease, never holding up its renewals."""
        self._look_for_orphans()
        self._renew_identities()
        self._look_at_node_network()

    def look_soon(self) -> None:
        """Look for attempts the runs no longer have at the next look (the lease was taken again), the watched ones
        too: a run that lost its machine meanwhile cancelled their watches, which no cancellation reaches (they send
        no heartbeat), and started them again elsewhere or as a new attempt."""
        self._orphan_look_due = 0.0
        self._doubt_watches = True

    # ---- adoption ------------------------------------------------------------------------------------------------

    async def adopt(self) -> int:
        """At the start of an agent process: the attempts its machine holds (an earlier process's) are watched by
        no one, so each that still runs, or exited 0 within RETURNED_KEPT_SECONDS, is told to its run when it ends
        as an exit its run may have lost with the machine (`task_exited_while_lost`); a run that did not lose it
        ignores that. Those whose runs no longer have them (the machine was lost meanwhile) are stopped now, before
        the machine takes work again: their GPUs are free when the scheduler counts them free. Returns how many it
        adopted."""
        keys = await asyncio.to_thread(self._runtime.attempts)
        observed = await asyncio.gather(*(asyncio.to_thread(self._runtime.observe, key) for key in keys))
        now = time.time()
        adopted = [
            key
            for key, seen in zip(keys, observed, strict=True)
            if seen.running
            or (seen.exit_code == 0 and seen.ended_at is not None and now - seen.ended_at < RETURNED_KEPT_SECONDS)
        ]
        for key in adopted:
            self._attempts.unwatched(key)
        await self.remove_deleted_runs()
        await self.stop_orphans(tell=False)  # told at the first look once registered: that waits for nothing
        return len(adopted)

    # ---- its own workers, deleted runs ---------------------------------------------------------------------

    async def stop_own_tasks(self, grace_seconds: float) -> int:
        """Stop every attempt this agent started or watched that still runs (its lease is lost: the runs count
        them lost and start them again elsewhere); returns how many it stopped."""
        keys = self._attempts.ours_all()
        observed = await asyncio.gather(*(asyncio.to_thread(self._runtime.observe, key) for key in keys))
        return await self._stop([key for key, seen in zip(keys, observed, strict=True) if seen.running], grace_seconds)

    async def stop_everything(self) -> int:
        """Stop every worker that runs on this machine, whoever started it (the fence); returns how many."""
        try:
            running = await asyncio.to_thread(self._runtime.running)
        except Exception as err:  # the engine does not answer: the next look tries again
            log.warning("%s: could not list its workers to stop them: %s", self.node_name, err)
            return 0
        return await self._stop(running, self._settings.stop_grace_seconds)

    async def _stop(self, keys: list[TaskRef], grace_seconds: float) -> int:
        """Stop these attempts at once, each within its grace; one that cannot be stopped is logged."""
        results = await asyncio.gather(
            *(self._starter.stop(key, grace_seconds) for key in keys), return_exceptions=True
        )
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("%s: could not stop %s: %s", self.node_name, key.slug, result)
        return len(keys)

    async def delete_run(self, input: DeleteRunFilesInput) -> DeletedFiles:
        """Remove every attempt of a deleted run here (stopping any that still runs): directory or container, log
        and files. Called again, it finds nothing left."""
        keys = await asyncio.to_thread(self._runtime.attempts)
        mine = [key for key in keys if (key.namespace, key.job) == (input.namespace, input.job)]
        for key in mine:
            activity.heartbeat(key.slug)
            await self._starter.delete(key, self._settings.stop_grace_seconds)
            self._attempts.forget(key)
        return DeletedFiles(attempts=len(mine))

    async def remove_deleted_runs(self) -> int:
        """Before this machine takes work again (its agent started, or registers again after its lease expired),
        remove the attempts of runs deleted while it was away: those of a run with a tombstone whose workflow is
        gone, or is the deleted one; of a name used again by a new run, those the new run does not have here. A run
        that cannot be read now is looked at again next time. Returns how many attempts it removed."""
        try:
            keys = await asyncio.to_thread(self._runtime.attempts)
            runs = sorted({(key.namespace, key.job) for key in keys})
            found = await tombstones(self._client, runs=runs) if runs else []
        except Exception as err:  # the engine or Temporal does not answer: next time
            log.warning("%s: could not look for deleted runs' files: %s", self.node_name, err)
            return 0
        removed = 0
        for namespace, job in sorted({(t.namespace, t.name) for t in found}):
            try:
                gone = await self._deleted_attempts(namespace, job, {t.run_id for t in found if t.name == job
                                                                     and t.namespace == namespace})  # fmt: skip
                for key in [k for k in keys if (k.namespace, k.job) == (namespace, job) and gone(k)]:
                    log.warning("%s: removing %s: its run was deleted", self.node_name, key.slug)
                    await self._starter.delete(key, self._settings.stop_grace_seconds)
                    removed += 1
            except Exception as err:
                log.warning("%s: could not remove the files of deleted run %s/%s: %s", self.node_name, namespace,
                            job, err)  # fmt: skip
        return removed

    async def _deleted_attempts(self, namespace: str, job: str, deleted: set[str]) -> Callable[[TaskRef], bool]:
        """Which attempts of a run named so are a deleted run's: all of them while its workflow is gone or is a
        deleted one; none while it is a later run that ended; those it does not have here while it is open."""
        try:
            described = await self._client.get_workflow_handle(job_id(namespace, job)).describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return lambda key: True
            raise
        if described.run_id in deleted:
            return lambda key: True
        if described.status != WorkflowExecutionStatus.RUNNING:
            return lambda key: False
        answer = await self.attempts_of(namespace, job)
        return lambda key: _stale(answer, key.task_id, key.attempt) is not None

    # ---- fencing: a start, or a worker, whose attempt its run no longer has here ---------------------------------

    async def fence(self, ref: TaskRef) -> None:
        """Refuse the start (non-retryable, nothing started) unless its run still has this attempt here. A run that
        does not answer now fails the try, to be tried again."""
        answer = await self.attempts_of(ref.namespace, ref.job)
        why = _stale(answer, ref.task_id, ref.attempt)
        if why is not None:
            reason = R.StartRefused(attempt=ref.attempt, task=ref.task_id, why=why)
            log.warning("%s: %s of run %s/%s", self.node_name, reason.text, ref.namespace, ref.job)
            raise ApplicationError(reason.text, type=reason.code, non_retryable=True)

    async def attempts_of(self, namespace: str, job: str) -> AttemptsOnNode | None:
        """The attempts a run has on this machine (query `attempts_on`); None when its workflow does not exist."""
        handle = self._client.get_workflow_handle(job_id(namespace, job))
        try:
            answer = await contracts.query(handle, contracts.ATTEMPTS_ON, AttemptsQuery(node=self.node_name))
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        return answer

    # ---- looks beside the lease -------------------------------------------------------------------------------

    def _look_at_node_network(self) -> None:
        """Until the machine's node network is up, ask for its subnet and make it, then refresh the mesh's peers,
        beside the lease (an answer that is slow to come must not hold up the lease's renewals)."""
        if self._network_look is None or self._network_look.done():
            self._network_look = asyncio.ensure_future(self.node_network.look())

    def _renew_identities(self) -> None:
        """Renew the certificates of running workers past half their life, beside the lease's heartbeats."""
        if self._identities is None or (self._identity_renewal is not None and not self._identity_renewal.done()):
            return
        self._identity_renewal = asyncio.ensure_future(self._renew_running_identities(self._identities))

    async def _renew_running_identities(self, identities: Identities) -> None:
        try:
            if await asyncio.to_thread(identities.held):
                await identities.renew(await asyncio.to_thread(self._runtime.running))
        except Exception as err:  # the engine or Temporal does not answer: next time
            log.warning("%s: could not renew its workers' identities: %s", self.node_name, err)

    def _look_for_orphans(self) -> None:
        """Start a look for orphaned workers when one is due and none is under way. It runs beside the lease's
        heartbeats (describes, and stops that wait out their grace), never holding them up."""
        if self._orphan_look is not None and not self._orphan_look.done():
            return
        now = time.monotonic()
        if now < self._orphan_look_due:
            return
        self._orphan_look_due = now + self._settings.orphan_check_seconds
        self._orphan_look = asyncio.ensure_future(self.stop_orphans())

    async def stop_orphans(self, tell: bool = True) -> None:
        """Stop every worker that runs here while its run's workflow is closed, terminated (the Temporal UI's
        Terminate button) or gone, or while its open run no longer has that attempt here (it was lost with the
        machine, or the run moved on): nothing else would ever stop it. Each stop is written in the machine's
        history. A run that cannot be read now (Temporal does not answer) is looked at again next time. Exits 0 its
        runs may have lost are told first: a run about to restart such a worker must hear it before its back-off
        ends, and reading the runs takes a while on a busy server."""
        if tell:
            await self._tell_exits_while_lost()
        try:
            running = await asyncio.to_thread(self._runtime.running)
        except Exception as err:  # the engine does not answer: look again next time
            log.warning("%s: could not list its workers: %s", self.node_name, err)
            return
        # The runs with an attempt here that no activity of this agent watches are read at every look (a describe
        # each); those whose attempts are all watched, once every WATCHED_RUN_LOOKS looks. A watch sends no heartbeat
        # (protocol 7: the lease carries its worker's liveness), so no answer to one says that its run was closed;
        # a run that stops wanting its worker stops it. Asking about every run (a visibility query per machine each
        # look) cost a busy server a slow read every 5 s per machine, which held up its writes (bench/README.md).
        doubt, self._doubt_watches = self._doubt_watches, False
        runs = sorted({(key.namespace, key.job) for key in running if doubt or not self._attempts.watched(key)})
        runs = sorted({*runs, *self._watched_runs_due(running)})
        for namespace, job in runs:
            keys = [key for key in running if (key.namespace, key.job) == (namespace, job)]
            try:
                stale = await self._not_the_runs(namespace, job, keys, doubt)
            except Exception as err:
                log.warning("%s: could not read run %s/%s: %s", self.node_name, namespace, job, err)
                self._doubt_watches = self._doubt_watches or doubt  # asked again at the next look
                continue
            for key, report in stale:
                log.warning("%s: stopping %s: %s", self.node_name, key.slug, report)
                try:
                    await self._starter.stop(key, self._settings.stop_grace_seconds)
                except Exception as err:  # tried again at the next look, since it still runs
                    log.warning("%s: could not stop %s: %s", self.node_name, key.slug, err)
                    continue
                self._orphans_untold.append(report)
        if tell:
            await self._tell_orphans_stopped()

    def _watched_runs_due(self, running: list[TaskRef]) -> list[tuple[str, str]]:
        """The runs with a worker here due a read of whether their workflow is still open (counted from when each
        was first seen here, so that the reads spread over the looks); the others are forgotten."""
        now, every = time.monotonic(), WATCHED_RUN_LOOKS * self._settings.orphan_check_seconds
        here = {(key.namespace, key.job) for key in running}
        self._runs_read = {run: at for run, at in self._runs_read.items() if run in here}
        due = []
        for run in sorted(here):
            read = self._runs_read.setdefault(run, now)
            if now - read >= every:
                due.append(run)
                self._runs_read[run] = now
        return due

    async def _tell_exits_while_lost(self) -> None:
        """Tell each run whose worker's watch ended before the worker did, and which then exited 0, that it did
        (signal `task_exited_while_lost`): a run that lost it with the machine and has not run it again yet counts
        it completed. What cannot be told now is told at the next look; other ends are forgotten."""
        for key in self._attempts.unwatched_all():
            if self._attempts.watched(key):  # watched again: its watch reports its end
                self._attempts.told(key)
                continue
            observed = await asyncio.to_thread(self._runtime.observe, key)
            if observed.running:
                continue
            if observed.exit_code == 0 and not observed.oom:
                report = ExitedWhileLost(task_id=key.task_id, attempt=key.attempt, node=self.node_name)
                try:
                    run = self._client.get_workflow_handle(job_id(key.namespace, key.job))
                    await contracts.signal(run, contracts.TASK_EXITED_WHILE_LOST, report)
                except Exception as err:
                    gone = isinstance(err, RPCError) and err.status == RPCStatusCode.NOT_FOUND  # its run closed
                    log.warning("%s: could not tell %s exited 0: %s", self.node_name, key.slug, err)
                    if not gone:
                        continue
                else:
                    log.warning("%s: %s exited 0 while its run had lost it: told its run", self.node_name, key.slug)
            self._attempts.told(key)

    async def _not_the_runs(
        self, namespace: str, job: str, keys: list[TaskRef], watched_too: bool = False
    ) -> list[tuple[TaskRef, OrphanStopped]]:
        """The attempts of one run running here that it no longer has: all of them when its workflow is no longer
        open; else those no activity of this agent watches (any, `watched_too`) whose attempt the run does not have
        here (one query)."""
        run = f"{namespace}/{job}"
        status = await self._closed_run(namespace, job)
        if status is not None:
            return [(key, OrphanStopped(task=key.task_id, run=run, status=status)) for key in keys]
        unwatched = [key for key in keys if watched_too or not self._attempts.watched(key)]
        if not unwatched:
            return []
        answer = await self.attempts_of(namespace, job)
        return [
            (key, OrphanStopped(task=key.task_id, run=run, status=why, attempt=key.attempt))
            for key in unwatched
            if (why := _stale(answer, key.task_id, key.attempt)) is not None
        ]

    async def _closed_run(self, namespace: str, job: str) -> str | None:
        """How Temporal has a run's workflow when it is no longer open ("terminated", "completed", "not found",
        ...); None while it is open (its latest execution, after any continue-as-new, is running)."""
        try:
            described = await self._client.get_workflow_handle(job_id(namespace, job)).describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return "not found"
            raise
        if described.status in (None, WorkflowExecutionStatus.RUNNING):
            return None
        return described.status.name.lower().replace("_", " ")

    async def _tell_orphans_stopped(self) -> None:
        """Write each orphan stopped in the machine's history (update `report_orphan_stopped`); what the machine's
        workflow does not take now is told at the next look."""
        handle = self._client.get_workflow_handle(node_id(self.node_name))
        while self._orphans_untold:
            try:
                await contracts.update(handle, contracts.REPORT_ORPHAN_STOPPED, self._orphans_untold[0])
            except Exception as err:
                log.warning("%s: could not write a stopped orphan in its history: %s", self.node_name, err)
                return
            self._orphans_untold.pop(0)


def _stale(answer: AttemptsOnNode | None, task: str, attempt: int) -> str | None:
    """Why attempt `attempt` of worker `task` is no longer its run's on this machine; None while it is."""
    if answer is None:
        return "its run no longer exists"
    if not answer.open:
        return "its run ended"
    current = answer.attempts.get(task)
    if current is None:
        return "its run no longer has it on this machine"
    if current != attempt:
        return f"its run has attempt {current} here now"
    return None
