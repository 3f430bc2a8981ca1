"""The node agent's activities: hold the machine's lease, and start, supervise and stop its workers.

Every activity is idempotent: an attempt's container is named by run, worker and attempt, so a retried start
finds its own, and a supervisor that restarts re-attaches to a worker that kept running.

Fencing: a start that may be stale (a retry, one that waited in the queue longer than a lease, one scheduled before
this agent last registered, or one that took that long to set up) asks its run (query `attempts_on`) whether the
attempt is still the run's on this machine, and is refused otherwise; and the lease's holder stops any running
attempt whose run no longer has it, so no worker runs twice. A fresh first start asks nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.capabilities import CapabilitySetup, Services
from activities.deletion import tombstones
from activities.drives import DriveActivities, DriveStore
from activities.gpus import GpuWatch
from activities.identities import Identities
from activities.machine import PressureWatch
from activities.mesh import Mesh
from activities.node_network import NodeNetwork
from activities.prepare import Preparer
from activities.runtime.base import Observed, Runtime, TaskKey, readable
from activities.sessions import SessionRefused, Sessions
from activities.starter import SetupEnded, Starter
from workflows import contracts
from workflows.contracts import implements, node_id
from workflows.domain.inventory import GpuInfo, NodeInventory, NodeView
from workflows.domain.machine.decisions import GpusReported, OrphanStopped, PressureReported
from workflows.domain.reasons import R, Reason
from workflows.domain.run.events import ExitedWhileLost, TaskHealth, TaskProgress, TaskRunning
from workflows.domain.settings import Settings
from workflows.domain.spec import Readiness, job_id
from workflows.messages import (
    Attached,
    AttachInput,
    AttemptsOnNode,
    AttemptsQuery,
    DeletedFiles,
    DeleteRunFilesInput,
    GrantSessionInput,
    LeaseInput,
    LogText,
    ReadLogInput,
    RunTaskInput,
    SessionGranted,
    StartTaskInput,
    StartTaskResult,
    StopTaskInput,
    SuperviseInput,
    TaskExit,
    TaskRef,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M")
# A worker is looked at often while young (short workers end soon, and their run waits for that), then once a
# second: a machine with hundreds of long workers must not spend its CPU asking each of them four times a second.
POLL_SECONDS = 0.25
POLL_SECONDS_SETTLED = 1.0
SETTLED_AFTER_SECONDS = 5.0
EXPIRED = "its lease expired"  # why a lease was lost: this agent registers again
TAKEN_OVER = "its lease was taken over"  # another agent holds the machine: this one stops its workers and ends
GPU_HEALTH_SECONDS = 5.0  # how often the lease's holder looks at the GPUs' health (and the machine's pressure)
PRESSURE_READ_SECONDS = 1.0
PAUSE_FLOOR_SECONDS = 5.0  # a lease's loop unheard for this long (at least) counts the lease lost: it was paused
# How long an exit returned to a run is remembered: should the lease expire meanwhile, it is told to its run again.
RETURNED_KEPT_SECONDS = 600.0  # a pressure read still going after this is collected at a later look
# A worker whose setting up takes longer than this is told to its run as picked up (Preparing) while it lasts; a
# quicker one is told once, started and running, with when it was picked up and started (no signal more).
PICK_UP_REPORT_SECONDS = 1.0


def task_key(ref: TaskRef) -> TaskKey:
    return TaskKey(namespace=ref.namespace, job=ref.job, task=ref.task_id, attempt=ref.attempt)


class AgentActivities:
    def __init__(
        self,
        client: Client,
        inventory: NodeInventory,
        runtime: Runtime,
        preparer: Preparer,
        gpu_watch: GpuWatch | None = None,
        pressure_watch: PressureWatch | None = None,
        settings: Settings | None = None,
        instance: str = "",
        identities: Identities | None = None,
        services: Services | None = None,
        sessions: Sessions | None = None,
        mesh: Mesh | None = None,
    ) -> None:
        self._client = client
        self._inventory = inventory
        self.node_name = inventory.name
        self.instance = instance  # this agent process ("host:pid:token"), as its machine's lease names it
        self.lost = asyncio.Event()  # set once its lease is lost: the agent then stops its workers and exits
        self.lost_why = ""
        self._attempts: set[TaskKey] = set()  # attempts this agent started or watched: its workers
        self._runtime = runtime
        self._gpus = list(inventory.gpus)  # with their health as last reported to the machine's workflow
        self._gpu_watch = gpu_watch
        self._pressure_watch = pressure_watch
        self._pressure = list(inventory.pressure)  # as last reported to the machine's workflow
        self._pressure_read: asyncio.Future[list[str]] | None = None
        if preparer.store is None:
            preparer.store = DriveStore(inventory.name)
        self.drives = DriveActivities(client, preparer.store)  # its data location and copies of drives
        self._identities = identities
        self._identity_renewal: asyncio.Task[None] | None = None  # the renewal of certificates under way
        capabilities = CapabilitySetup(services or Services(), inventory.capabilities, inventory.capability_notes)
        self.node_network = NodeNetwork(client, inventory.name, runtime, mesh)
        self._network_look: asyncio.Task[object] | None = None  # making the network, refreshing the mesh's peers
        self._starter = Starter(
            runtime,
            preparer,
            lambda: self._gpus,
            self._report_progress,
            catalogue=self.drives.catalogue,
            ports=inventory.external_ports,
            identities=identities,
            capabilities=capabilities,
            sessions=sessions,
            node_network=lambda: self.node_network.up,
        )
        self._sessions = sessions
        self._settings = settings or Settings()
        self._orphan_look: asyncio.Task[None] | None = None  # the look for orphaned workers under way
        self._orphan_look_due = 0.0  # time.monotonic() of the next look
        self._orphans_untold: list[OrphanStopped] = []  # stopped, not yet written in the machine's history
        self.registered_at: datetime | None = None  # when the machine's workflow took this agent's latest registration
        self.registrations = 0  # how often this agent registered: a start begun before the latest one is fenced
        self._lease_seen = time.monotonic()  # when hold_lease last ran here
        self._leases = 0  # hold_lease activities begun here: a newer one carries the lease of a run continued as new
        self._live: dict[TaskKey, int] = {}  # attempts an activity of this agent starts or watches now
        self._unwatched: set[TaskKey] = set()  # attempts whose watch ended before they did (their run lost them?)
        self._returned: dict[TaskKey, float] = {}  # attempts whose watch returned their exit lately, and when
        self._picked_up: dict[TaskKey, datetime] = {}  # attempts being set up, and when this agent picked them up
        self._told_setting_up: set[TaskKey] = set()  # of those, the ones whose run was told something already

    async def adopt_attempts(self) -> int:
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
        self._unwatched.update(adopted)
        await self.remove_deleted_runs()
        await self._stop_orphans(tell=False)  # told at the first look once registered: that waits for nothing
        return len(adopted)

    def registered(self, view: NodeView) -> None:
        """The machine's workflow took this agent's registration (its first, or again after its lease expired): it
        holds the lease again, and looks at once for attempts its runs no longer have."""
        self.registered_at = view.since
        self.node_network.forget()  # asked again: a machine removed meanwhile had its subnet freed
        self.drives.chosen(view.data_location)
        if self.registrations:
            # Its lease had expired: an exit returned lately may never have reached its run (the activity had
            # timed out, or its run had given up on it when the machine was lost): tell the run again.
            now = time.monotonic()
            self._unwatched.update(key for key, at in self._returned.items() if now - at < RETURNED_KEPT_SECONDS)
            self._returned.clear()
        self.registrations += 1
        self.lost_why = ""
        self.lost.clear()
        self._lease_seen = time.monotonic()
        self._orphan_look_due = 0.0

    def inventory(self) -> NodeInventory:
        """What the machine has, with its GPUs' health and its pressure as last seen: what it registers again."""
        data = self.drives.store.report()
        return self._inventory.model_copy(
            update={"gpus": list(self._gpus), "pressure": list(self._pressure), **dict(data)}
        )

    def lease_idle_seconds(self) -> float:
        """How long no lease was held here: long past its TTL, the machine's workflow holds none for this agent."""
        return time.monotonic() - self._lease_seen

    @implements(contracts.hold_lease)
    async def hold_lease(self, input: LeaseInput) -> None:
        """Renew the machine's lease by heartbeating until the control plane cancels it; meanwhile report the
        GPUs' health and the machine's pressure to the machine's workflow when they change."""
        registrations = self.registrations
        self._leases += 1
        lease = self._leases
        # The lease's heartbeat timeout (renewals come three times within it); at least PAUSE_FLOOR_SECONDS, so that
        # a slow look (a pressure read is waited for up to a second) on a loaded machine is not mistaken for a pause.
        ttl = max(3 * input.renew_seconds, PAUSE_FLOOR_SECONDS)
        # The loop looks twice per renewal (the GPUs' health, orphans, identities), and renews (heartbeats) at the
        # look that comes a renewal after the last: a crashed agent's lease expires 2/3 to all of its TTL after the
        # crash. Each renewal is a write of the machine's workflow: renewing at every look cost the server as many
        # writes again, 13 a second for 64 machines, a burst or not (bench/README.md).
        period = min(input.renew_seconds / 2, GPU_HEALTH_SECONDS)
        reporting = asyncio.ensure_future(self._keep_reporting(period))
        renewed = due = time.monotonic()  # the last renewal (at first: the lease's start), and when the next is due
        try:
            while True:
                now = time.monotonic()
                if now - renewed > ttl:
                    # Unheard for longer than its lease (this agent was paused): it expired on the server already.
                    # Count it lost now, before any look for orphans acts on what the agent saw before the pause.
                    self.lost_why = EXPIRED
                    self.lost.set()
                    return
                self._lease_seen = now
                if now >= due - period / 2:
                    renewed, due = now, now + input.renew_seconds
                    activity.heartbeat()
                self._look_for_orphans()
                self._renew_identities()
                self._look_at_node_network()
                await asyncio.sleep(period)
        except asyncio.CancelledError:
            details = activity.cancellation_details()
            replaced = self.registrations != registrations  # this agent registered again: a new lease replaces it
            if (
                not replaced
                and (details is None or not details.worker_shutdown)
                and not await self._carried(lease, ttl)
            ):
                # Cancelled by the machine's workflow (another agent took it over), or unknown to the server (it
                # expired while this agent was away): either way this agent no longer holds the machine. An expired
                # lease is taken again (the agent registers again); a lease taken over ends the agent.
                expired = details is not None and (details.not_found or details.timed_out)
                self.lost_why = EXPIRED if expired else TAKEN_OVER
                self.lost.set()
            raise
        finally:
            reporting.cancel()

    async def _keep_reporting(self, period: float) -> None:
        """Tell the machine's workflow the GPUs' health, the machine's pressure and its data location when they
        change, on a loop of their own beside the lease's: each report is an update that waits for the machine's
        workflow task, which a burst of runs can hold up for many seconds, and a renewal must never wait for it (in a
        500-run burst two machines lost their leases while these reports were awaited between renewals)."""
        while True:
            for report in (self._report_gpu_health, self._report_pressure, self.drives.report):
                try:
                    await report()
                except Exception:  # told again at the next look
                    log.exception("%s: a report to the machine's workflow failed", self._inventory.name)
            await asyncio.sleep(period)

    def _look_at_node_network(self) -> None:
        """Until the machine's node network is up, ask for its subnet and make it, then refresh the mesh's peers,
        beside the lease (an answer that is slow to come must not hold up the lease's renewals)."""
        if self._network_look is None or self._network_look.done():
            self._network_look = asyncio.ensure_future(self.node_network.look())

    async def _carried(self, lease: int, ttl: float) -> bool:
        """Whether the machine's workflow continued as new holding this lease (its former run's lease activity is
        then unknown to the server): the new run's lease comes to this agent, which holds the machine still. Waited
        for up to the lease's TTL; an answer that does not come counts the lease lost (the agent registers again)."""
        info = activity.info()
        try:
            handle = self._client.get_workflow_handle(node_id(self.node_name), run_id=info.workflow_run_id)
            if self._leases == lease and (await handle.describe()).status != WorkflowExecutionStatus.CONTINUED_AS_NEW:
                return False
            async with asyncio.timeout(ttl):
                while self._leases == lease:
                    await asyncio.sleep(0.05)
        except (RPCError, TimeoutError):
            return False
        log.info("%s: its lease went on in the machine's workflow continued as new", self.node_name)
        return True

    @implements(contracts.start_task)
    async def start_task(self, input: StartTaskInput) -> StartTaskResult:
        """Admit the attempt within the machine's real free GPUs, prepare it (reporting each wait to the run,
        and waiting as long as a step waits), pull its image, and start it. A retry finds what it started.
        With `barrier` it stops short of the start, its GPUs held for it until the run starts or stops it."""
        gpus, started, picked_up, held = await self._start(input)
        return StartTaskResult(gpu_indices=gpus, started=started, picked_up_at=picked_up, node_address=held)

    @implements(contracts.run_task)
    async def run_task(self, input: RunTaskInput) -> TaskExit:
        """A worker's whole life here in one activity: start it (as start_task), tell the run it was started and
        runs, then watch it until it ends (as supervise_task). Called again, it finds what it started."""
        _, _, picked_up, _ = await self._start(input.start, input.settings)
        ref = input.start.ref
        started_at = datetime.now(UTC)
        external = await self._external(task_key(ref)) if input.start.group.external_access else {}
        address = await self.node_network.address_of(task_key(ref)) if input.start.group.on_mesh else None
        report = TaskRunning(
            **ref.ids(), started=True, picked_up_at=picked_up, started_at=started_at, external=external,
            node_address=address,
        )  # fmt: skip
        return await self._watch(ref, input.settings, input.readiness, report)

    async def _external(self, key: TaskKey) -> dict[str, str]:
        """Where people reach the attempt's external access: this machine's address and the ports it holds."""
        held = await asyncio.to_thread(self._runtime.ports_in_use)
        return {name: f"{self._inventory.address}:{port}" for name, port in sorted(held.get(key.slug, {}).items())}

    async def _start(
        self, input: StartTaskInput, settings: Settings | None = None
    ) -> tuple[list[int], bool, datetime, str | None]:
        """Its GPUs, whether it started, when this agent picked it up, and at the barrier the address held for it on
        the node network. A setup that takes longer than PICK_UP_REPORT_SECONDS with nothing else told is told to
        the run as picked up while it lasts."""
        key = task_key(input.ref)
        _beat_later(settings or self._settings)
        picked_up = datetime.now(UTC)
        self._picked_up[key] = picked_up
        teller = asyncio.ensure_future(self._tell_picked_up(key))
        try:
            gpus, started, held = await self._admit_and_start(input, key)
        finally:
            teller.cancel()
            self._picked_up.pop(key, None)
            self._told_setting_up.discard(key)
        return gpus, started, picked_up, held

    async def _tell_picked_up(self, key: TaskKey) -> None:
        await asyncio.sleep(PICK_UP_REPORT_SECONDS)
        if key in self._told_setting_up:
            return  # a wait or a pull was told: the run shows it picked up already
        try:
            await self._report_progress(key, R.PickedUp(node=self.node_name))
        except Exception as err:  # the report of its start says it later
            log.warning("%s: could not tell its run it was picked up: %s", key.slug, err)

    async def _admit_and_start(self, input: StartTaskInput, key: TaskKey) -> tuple[list[int], bool, str | None]:
        began, registrations = time.monotonic(), self.registrations
        details = activity.info().heartbeat_details
        _beat(str(details[0]) if details else "starting")  # a start that queues is not a dead agent
        if self._doubtful(activity.info()):
            await self._fence(input.ref)

        async def fence() -> None:
            """Just before the runtime starts it: ask again if it took a lease's time, or the lease changed."""
            if self._lease_changed(began, registrations):
                await self._fence(input.ref)

        with self._live_attempt(key):
            return await self._set_up_and_start(input, key, fence)

    async def _set_up_and_start(
        self, input: StartTaskInput, key: TaskKey, fence: Callable[[], Awaitable[None]]
    ) -> tuple[list[int], bool, str | None]:
        self._attempts.add(key)
        env = {
            **input.group.env,
            **input.env,
            "ASTRAEUS_NODE": self._inventory.name,
            "ASTRAEUS_GROUP": input.group.name,
        }
        details = activity.info().heartbeat_details
        reported = str(details[0]) if details else None
        try:
            if input.barrier:
                return await self._starter.ready(key, input.group, env, _beat, reported)
            gpus = await self._starter.start(key, input.group, env, _beat, reported, input.host_network, fence)
        except SetupEnded as ended:
            raise ApplicationError(ended.reason.text, type=ended.reason.code, non_retryable=True) from None
        return gpus, True, None

    @implements(contracts.supervise_task)
    async def supervise_task(self, input: SuperviseInput) -> TaskExit:
        """Report the worker running, then watch it until it ends, heartbeating all along; with a readiness
        check, report its health to the run whenever it changes. A supervisor that re-attached after a missed
        heartbeat says it is heard again."""
        report = TaskRunning(**input.ref.ids(), heartbeat=input.reattach)
        _beat_later(input.settings)
        return await self._watch(input.ref, input.settings, input.readiness, report)

    async def _watch(
        self, ref: TaskRef, settings: Settings, readiness: Readiness | None, report: TaskRunning
    ) -> TaskExit:
        key = task_key(ref)
        self._unwatched.discard(key)
        registrations = self.registrations
        with self._live_attempt(key):
            try:
                ended, paused = await self._watch_attempt(ref, settings, readiness, report)
            except BaseException:
                # Cancelled (its run lost it with the machine, say) or failed: should it exit 0 on its own, its run
                # is told at a later look for orphans, so finished work is not run again.
                self._unwatched.add(key)
                raise
        if paused > self._settings.node_lease_ttl_seconds or self._lease_changed(time.monotonic(), registrations):
            self._unwatched.add(key)  # this result may reach no one: its run is told again at a later look
        else:
            now = time.monotonic()
            self._returned = {k: at for k, at in self._returned.items() if now - at < RETURNED_KEPT_SECONDS}
            self._returned[key] = now
        return ended

    async def _watch_attempt(
        self, ref: TaskRef, settings: Settings, readiness: Readiness | None, report: TaskRunning
    ) -> tuple[TaskExit, float]:
        """Its exit, and the longest this agent went unheard while watching it (paused, say)."""
        key = task_key(ref)
        self._attempts.add(key)
        ended = self._runtime.ended_fd(key)  # a worker whose end wakes this watch needs no polling
        checking = None
        try:
            # Nor a look while that end has not come: no thread is asked to look at a worker just started.
            if ended is not None and not readable(ended, 0):
                observed = Observed(running=True)
            else:
                observed = await asyncio.to_thread(self._runtime.observe, key)
            if observed.not_found:
                return TaskExit(not_found=True), 0.0
            await self._tell_run(ref.namespace, ref.job, contracts.TASK_RUNNING, report)
            if readiness is not None:
                checking = asyncio.ensure_future(self._check_health(ref, readiness))
            settled_at = time.monotonic() + SETTLED_AFTER_SECONDS
            # Heartbeats well within the grace, and looks well within a lease (a longer gap: this agent was paused)
            heartbeat = heartbeat_seconds(settings)
            settled = min(POLL_SECONDS_SETTLED, heartbeat)
            paused, looked = 0.0, time.monotonic()
            while observed.running:
                _beat()
                if ended is None:
                    await asyncio.sleep(POLL_SECONDS if time.monotonic() < settled_at else settled)
                    observed = await asyncio.to_thread(self._runtime.observe, key)
                elif await _readable(ended, heartbeat):  # else its shim lives: nothing to look at
                    observed = await asyncio.to_thread(self._runtime.observe, key)
                paused, looked = max(paused, time.monotonic() - looked), time.monotonic()
        finally:
            if ended is not None:
                os.close(ended)
            if checking is not None:
                checking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checking
        if observed.not_found:
            return TaskExit(not_found=True), paused
        tail = await asyncio.to_thread(self._runtime.log_tail, key, settings.log_tail_lines, settings.log_tail_bytes)
        return TaskExit(exit_code=observed.exit_code, oom=observed.oom, log_tail=tail), paused

    @implements(contracts.stop_task)
    async def stop_task(self, input: StopTaskInput) -> None:
        """The stop signal, the grace period, then a kill; returns once the worker has ended. A worker still
        being set up stops there."""
        key = task_key(input.ref)
        await _heartbeating(self._starter.stop(key, input.grace_seconds))

    async def stop_own_tasks(self, grace_seconds: float) -> int:
        """Stop every attempt this agent started or watched that still runs (its lease is lost: the runs count
        them lost and start them again elsewhere); returns how many it stopped."""
        keys = sorted(self._attempts, key=lambda k: k.slug)
        observed = await asyncio.gather(*(asyncio.to_thread(self._runtime.observe, key) for key in keys))
        running = [key for key, seen in zip(keys, observed, strict=True) if seen.running]
        results = await asyncio.gather(
            *(self._starter.stop(key, grace_seconds) for key in running), return_exceptions=True
        )
        for key, result in zip(running, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("%s: could not stop %s: %s", self._inventory.name, key.slug, result)
        return len(running)

    @implements(contracts.delete_run_files)
    async def delete_run_files(self, input: DeleteRunFilesInput) -> DeletedFiles:
        """Remove every attempt of a deleted run here (stopping any that still runs): directory or container, log
        and files. Called again, it finds nothing left."""
        keys = await asyncio.to_thread(self._runtime.attempts)
        mine = [key for key in keys if (key.namespace, key.job) == (input.namespace, input.job)]
        for key in mine:
            activity.heartbeat(key.slug)
            await self._starter.delete(key, self._settings.stop_grace_seconds)
            self._attempts.discard(key)
            self._unwatched.discard(key)
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

    async def _deleted_attempts(self, namespace: str, job: str, deleted: set[str]) -> Callable[[TaskKey], bool]:
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
        answer = await self._attempts_of(namespace, job)
        return lambda key: _stale(answer, key.task, key.attempt) is not None

    @implements(contracts.read_log)
    async def read_log(self, input: ReadLogInput) -> LogText:
        """An attempt's output (stdout and stderr), the last `max_bytes` of it, for `astraeus logs`."""
        key = task_key(input.ref)
        text = await asyncio.to_thread(self._runtime.log_tail, key, input.lines, input.max_bytes)
        return LogText(text=text)

    @implements(contracts.grant_session)
    async def grant_session(self, input: GrantSessionInput) -> SessionGranted:
        """Let the holder of a token run commands in a running attempt here, until it expires (its public key)."""
        sessions = self._hosting_sessions()
        try:
            expires = await asyncio.to_thread(
                sessions.grant, task_key(input.ref), input.public_key, input.ttl_seconds, datetime.now(UTC)
            )
        except SessionRefused as err:
            raise ApplicationError(str(err), type="SessionRefused", non_retryable=True) from None
        return SessionGranted(expires_at=expires)

    @implements(contracts.attach_session)
    async def attach_session(self, input: AttachInput) -> Attached:
        """Run a person's command in a running attempt here, for a request signed by a token granted for it."""
        sessions = self._hosting_sessions()
        try:
            return await asyncio.to_thread(sessions.attach, task_key(input.ref), input, datetime.now(UTC))
        except SessionRefused as err:
            raise ApplicationError(str(err), type="SessionRefused", non_retryable=True) from None

    def _hosting_sessions(self) -> Sessions:
        if self._sessions is None or not self._sessions.hosts:
            why = f"machine {self.node_name} hosts no interactive sessions (its agent runs --no-interactive-sessions)"
            raise ApplicationError(why, type="SessionRefused", non_retryable=True)
        return self._sessions

    async def _check_health(self, ref: TaskRef, readiness: Readiness) -> None:
        """Every period, run the readiness check on a thread (a slow check never delays a heartbeat) and signal
        `task_health` when its outcome changes; the first outcome is always told. Runs until cancelled."""
        key = task_key(ref)
        told: bool | None = None
        while True:
            began = time.monotonic()
            try:
                healthy, detail = await asyncio.to_thread(self._runtime.probe, key, readiness)
            except Exception as err:  # the runtime could not run the check (the engine does not answer)
                healthy, detail = False, f"the check could not run: {err}"
            if healthy != told:
                report = TaskHealth(task_id=ref.task_id, attempt=ref.attempt, healthy=healthy, detail=detail)
                try:
                    await self._tell_run(ref.namespace, ref.job, contracts.TASK_HEALTH, report)
                    told = healthy
                except Exception as err:  # told at the next check
                    log.warning("%s: could not report its health: %s", key.slug, err)
            await asyncio.sleep(max(0.0, readiness.period_seconds - (time.monotonic() - began)))

    async def _tell_run(self, namespace: str, job: str, signal: contracts.Signal[M], report: M) -> None:
        """Signal a run about its worker. From an activity of that run, the signal names the workflow run the activity
        belongs to, so the server need not look up the current one (a read for every signal: 1 of 14 persistence
        operations a run cost in a burst). A run that continued as new since is signalled by its workflow id."""
        workflow_id = job_id(namespace, job)
        info = activity.info() if activity.in_activity() else None
        if info is not None and info.workflow_id == workflow_id:
            handle = self._client.get_workflow_handle(workflow_id, run_id=info.workflow_run_id)
            try:
                return await contracts.signal(handle, signal, report)
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:  # that run closed: the current one is told below
                    raise
        await contracts.signal(self._client.get_workflow_handle(workflow_id), signal, report)

    async def _report_progress(self, key: TaskKey, reason: Reason) -> None:
        """Tell the run what its worker waits for while it is set up, or that its image is being pulled, or that
        it was picked up (and when: the run shows it Preparing since then)."""
        self._told_setting_up.add(key)
        report = TaskProgress(
            task_id=key.task,
            attempt=key.attempt,
            pulling=reason.code == R.Pulling.code,
            reason=reason,
            picked_up_at=self._picked_up.get(key),
        )
        await self._tell_run(key.namespace, key.job, contracts.TASK_PROGRESS, report)

    async def _report_gpu_health(self) -> None:
        """Tell the machine's workflow when a GPU faults or becomes at risk (update `report_gpus`)."""
        if self._gpu_watch is None:
            return
        gpus: list[GpuInfo] = await asyncio.to_thread(self._gpu_watch.poll)
        if gpus == self._gpus:
            return
        handle = self._client.get_workflow_handle(node_id(self._inventory.name))
        try:
            await contracts.update(handle, contracts.REPORT_GPUS, GpusReported(gpus=gpus))
        except Exception as err:  # told again at the next look
            log.warning("%s: could not report the GPUs' health: %s", self._inventory.name, err)
            return
        self._gpus = gpus

    async def _report_pressure(self) -> None:
        """Read the memory and disk pressure on a thread and tell the machine's workflow when the conditions change
        (update `report_pressure`). A read that hangs (a stalled mount under the data dir) is left running and
        collected at a later look, so it never holds up the lease's heartbeats."""
        if self._pressure_watch is None:
            return
        read = self._pressure_read
        if read is None:  # a new read usually ends at once; one still hanging from a former look is not waited for
            read = self._pressure_read = asyncio.ensure_future(
                asyncio.to_thread(self._pressure_watch.poll, list(self._pressure))
            )
            await asyncio.wait({read}, timeout=PRESSURE_READ_SECONDS)
        if not read.done():
            return
        self._pressure_read = None
        try:
            pressure = read.result()
        except OSError as err:
            log.warning("%s: could not read its pressure: %s", self._inventory.name, err)
            return
        if pressure == self._pressure:
            return
        handle = self._client.get_workflow_handle(node_id(self._inventory.name))
        try:
            await contracts.update(handle, contracts.REPORT_PRESSURE, PressureReported(pressure=pressure))
        except Exception as err:  # told again at the next look
            log.warning("%s: could not report its pressure: %s", self._inventory.name, err)
            return
        self._pressure = pressure

    # ---- fencing: a start, or a worker, whose attempt its run no longer has here ---------------------------------

    def _doubtful(self, info: activity.Info) -> bool:
        """Whether a start may be stale, so its run is asked first: a retry, one that waited in the queue longer
        than a lease (its machine may have been lost meanwhile), one scheduled before this agent last registered,
        or one arriving while the lease is lost. A fresh first start is not: it asks nothing."""
        ttl = timedelta(seconds=self._settings.node_lease_ttl_seconds)
        scheduled = info.current_attempt_scheduled_time
        return (
            info.attempt > 1
            or info.started_time - scheduled > ttl
            or (self.registered_at is not None and scheduled < self.registered_at)
            or self.lost.is_set()
        )

    def _lease_changed(self, began: float, registrations: int) -> bool:
        """Whether, since a start began, a lease's time passed (it waited to be set up, or this agent was paused)
        or this agent's lease was lost or taken again: its run may have moved on."""
        elapsed = time.monotonic() - began
        return (
            elapsed > self._settings.node_lease_ttl_seconds or self.registrations != registrations or self.lost.is_set()
        )

    async def _fence(self, ref: TaskRef) -> None:
        """Refuse the start (non-retryable, nothing started) unless its run still has this attempt here. A run that
        does not answer now fails the try, to be tried again."""
        answer = await self._attempts_of(ref.namespace, ref.job)
        why = _stale(answer, ref.task_id, ref.attempt)
        if why is not None:
            reason = R.StartRefused(attempt=ref.attempt, task=ref.task_id, why=why)
            log.warning("%s: %s of run %s/%s", self.node_name, reason.text, ref.namespace, ref.job)
            raise ApplicationError(reason.text, type=reason.code, non_retryable=True)

    async def _attempts_of(self, namespace: str, job: str) -> AttemptsOnNode | None:
        """The attempts a run has on this machine (query `attempts_on`); None when its workflow does not exist."""
        handle = self._client.get_workflow_handle(job_id(namespace, job))
        try:
            answer = await contracts.query(handle, contracts.ATTEMPTS_ON, AttemptsQuery(node=self.node_name))
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        return answer

    @contextlib.contextmanager
    def _live_attempt(self, key: TaskKey) -> Iterator[None]:
        """While an activity starts or watches the attempt, its run has it: the look for stale attempts skips it."""
        self._live[key] = self._live.get(key, 0) + 1
        try:
            yield
        finally:
            self._live[key] -= 1
            if not self._live[key]:
                del self._live[key]

    # ---- orphans: workers whose run's workflow is no longer open ------------------------------------------------

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
            log.warning("%s: could not renew its workers' identities: %s", self._inventory.name, err)

    def _look_for_orphans(self) -> None:
        """Start a look for orphaned workers when one is due and none is under way. It runs beside the lease's
        heartbeats (describes, and stops that wait out their grace), never holding them up."""
        if self._orphan_look is not None and not self._orphan_look.done():
            return
        now = time.monotonic()
        if now < self._orphan_look_due:
            return
        self._orphan_look_due = now + self._settings.orphan_check_seconds
        self._orphan_look = asyncio.ensure_future(self._stop_orphans())

    async def _stop_orphans(self, tell: bool = True) -> None:
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
            log.warning("%s: could not list its workers: %s", self._inventory.name, err)
            return
        # Only the runs with an attempt here that no activity of this agent watches are read (a describe each). A
        # watched attempt needs no look: its watch heartbeats to its run, and when the run closes or stops
        # wanting it, the server answers the heartbeat "not found" or "cancelled", the watch ends, and the attempt
        # is looked at next time. Asking about every run (a visibility query per machine each look) cost a busy
        # server a slow read every 5 s per machine, which held up its writes (bench/README.md).
        runs = sorted({(key.namespace, key.job) for key in running if key not in self._live})
        for namespace, job in runs:
            keys = [key for key in running if (key.namespace, key.job) == (namespace, job)]
            try:
                stale = await self._not_the_runs(namespace, job, keys)
            except Exception as err:
                log.warning("%s: could not read run %s/%s: %s", self._inventory.name, namespace, job, err)
                continue
            for key, report in stale:
                log.warning("%s: stopping %s: %s", self._inventory.name, key.slug, report)
                try:
                    await self._starter.stop(key, self._settings.stop_grace_seconds)
                except Exception as err:  # tried again at the next look, since it still runs
                    log.warning("%s: could not stop %s: %s", self._inventory.name, key.slug, err)
                    continue
                self._orphans_untold.append(report)
        if tell:
            await self._tell_orphans_stopped()

    async def _tell_exits_while_lost(self) -> None:
        """Tell each run whose worker's watch ended before the worker did, and which then exited 0, that it did
        (signal `task_exited_while_lost`): a run that lost it with the machine and has not run it again yet counts
        it completed. What cannot be told now is told at the next look; other ends are forgotten."""
        for key in sorted(self._unwatched, key=lambda k: k.slug):
            if key in self._live:  # watched again: its watch reports its end
                self._unwatched.discard(key)
                continue
            observed = await asyncio.to_thread(self._runtime.observe, key)
            if observed.running:
                continue
            if observed.exit_code == 0 and not observed.oom:
                report = ExitedWhileLost(task_id=key.task, attempt=key.attempt, node=self.node_name)
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
            self._unwatched.discard(key)

    async def _not_the_runs(self, namespace: str, job: str, keys: list[TaskKey]) -> list[tuple[TaskKey, OrphanStopped]]:
        """The attempts of one run running here that it no longer has: all of them when its workflow is no longer
        open; else those no activity of this agent watches whose attempt the run does not have here (one query)."""
        run = f"{namespace}/{job}"
        status = await self._closed_run(namespace, job)
        if status is not None:
            return [(key, OrphanStopped(task=key.task, run=run, status=status)) for key in keys]
        unwatched = [key for key in keys if key not in self._live]
        if not unwatched:
            return []
        answer = await self._attempts_of(namespace, job)
        return [
            (key, OrphanStopped(task=key.task, run=run, status=why, attempt=key.attempt))
            for key in unwatched
            if (why := _stale(answer, key.task, key.attempt)) is not None
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
        handle = self._client.get_workflow_handle(node_id(self._inventory.name))
        while self._orphans_untold:
            try:
                await contracts.update(handle, contracts.REPORT_ORPHAN_STOPPED, self._orphans_untold[0])
            except Exception as err:
                log.warning("%s: could not write a stopped orphan in its history: %s", self._inventory.name, err)
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


# When an attempt's activity may send its first heartbeat (time.monotonic()). The SDK sends an activity's first
# heartbeat at once, then one per throttle interval: beating from the first moment cost a burst one write per worker
# at its start, when the server can least afford it, and one interval in, 1.7 writes per run in a burst of 500
# (bench/README.md). Two intervals in (half the stale grace), 0.7 on a fast day and 1.5 on a slow one, a fifth of
# the server's writes. Three intervals in leaves a quarter of the grace for it to arrive, more than the SDK leaves
# each later one (it sends them at most every 0.8 of the heartbeat timeout, the grace).
_first_beat_at: ContextVar[float] = ContextVar("first_beat_at", default=0.0)
FIRST_BEAT_INTERVALS = 3


def heartbeat_seconds(settings: Settings) -> float:
    """How often a worker's watch heartbeats: well within the stale grace, and within a lease."""
    return min(settings.stale_grace_seconds, settings.node_lease_ttl_seconds) / 4


def _beat_later(settings: Settings) -> None:
    """This activity's first heartbeat waits FIRST_BEAT_INTERVALS heartbeat intervals (`_first_beat_at`)."""
    _first_beat_at.set(time.monotonic() + FIRST_BEAT_INTERVALS * heartbeat_seconds(settings))


def _beat(doing: str | None = None) -> None:
    """Heartbeat (with what the attempt is doing, for a retry to read), unless its activity began less than
    FIRST_BEAT_INTERVALS heartbeat intervals ago."""
    if time.monotonic() < _first_beat_at.get():
        return
    if doing is None:
        activity.heartbeat()
    else:
        activity.heartbeat(doing)


async def _heartbeating(work: Awaitable[T]) -> T:
    """Await `work` while heartbeating, so a long stop is not mistaken for a dead agent."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(1)

    beater = asyncio.ensure_future(beat())
    try:
        return await work
    finally:
        beater.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beater


async def _readable(fd: int, seconds: float) -> bool:
    """Wait until `fd` is readable or `seconds` passed, whichever comes first; whether it is readable."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        loop.remove_reader(fd)
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await asyncio.wait([ready], timeout=seconds)
    finally:
        loop.remove_reader(fd)
    return ready.done()
