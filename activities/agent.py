"""The node agent's activities: hold the machine's lease, and start, supervise and stop its workers.

Every activity is idempotent: an attempt's container is named by run, worker and attempt, so a retried start
finds its own, and a supervisor that restarts re-attaches to a worker that kept running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable
from typing import TypeVar

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.gpus import GpuWatch
from activities.machine import PressureWatch
from activities.prepare import Preparer
from activities.runtime.base import Runtime, TaskKey
from activities.starter import SetupEnded, Starter
from workflows.domain.nodes import GpuInfo, NodeInventory, node_id
from workflows.domain.reasons import R, Reason
from workflows.domain.settings import Settings
from workflows.domain.spec import Readiness, job_id
from workflows.messages import (
    GpuHealthReport,
    LeaseInput,
    LogText,
    OrphanStoppedReport,
    PressureReport,
    ReadLogInput,
    RunTaskInput,
    StartTaskInput,
    StartTaskResult,
    StopTaskInput,
    SuperviseInput,
    TaskExit,
    TaskHealthReport,
    TaskProgressReport,
    TaskRef,
    TaskReport,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
# A worker is looked at often while young (short workers end soon, and their run waits for that), then once a
# second: a machine with hundreds of long workers must not spend its CPU asking each of them four times a second.
POLL_SECONDS = 0.25
POLL_SECONDS_SETTLED = 1.0
SETTLED_AFTER_SECONDS = 5.0
GPU_HEALTH_SECONDS = 5.0  # how often the lease's holder looks at the GPUs' health (and the machine's pressure)
PRESSURE_READ_SECONDS = 1.0  # a pressure read still going after this is collected at a later look


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
        self._starter = Starter(runtime, preparer, lambda: self._gpus, self._report_progress)
        self._settings = settings or Settings()
        self._orphan_look: asyncio.Task[None] | None = None  # the look for orphaned workers under way
        self._orphan_look_due = 0.0  # time.monotonic() of the next look
        self._orphans_untold: list[OrphanStoppedReport] = []  # stopped, not yet written in the machine's history

    @activity.defn(name="hold_lease")
    async def hold_lease(self, input: LeaseInput) -> None:
        """Renew the machine's lease by heartbeating until the control plane cancels it; meanwhile report the
        GPUs' health and the machine's pressure to the machine's workflow when they change."""
        try:
            while True:
                activity.heartbeat()
                self._look_for_orphans()
                await self._report_gpu_health()
                await self._report_pressure()
                await asyncio.sleep(min(input.renew_seconds, GPU_HEALTH_SECONDS))
        except asyncio.CancelledError:
            details = activity.cancellation_details()
            if details is None or not details.worker_shutdown:
                # Cancelled by the machine's workflow (another agent took it over), or unknown to the server (it
                # expired while this agent was away): either way this agent no longer holds the machine.
                expired = details is not None and (details.not_found or details.timed_out)
                self.lost_why = "its lease expired" if expired else "its lease was taken over"
                self.lost.set()
            raise

    @activity.defn(name="start_task")
    async def start_task(self, input: StartTaskInput) -> StartTaskResult:
        """Admit the attempt within the machine's real free GPUs, prepare it (reporting each wait to the run,
        and waiting as long as a step waits), pull its image, and start it. A retry finds what it started.
        With `barrier` it stops short of the start, its GPUs held for it until the run starts or stops it."""
        gpus, started = await self._start(input)
        return StartTaskResult(gpu_indices=gpus, started=started)

    @activity.defn(name="run_task")
    async def run_task(self, input: RunTaskInput) -> TaskExit:
        """A worker's whole life here in one activity: start it (as start_task), tell the run it was started and
        runs, then watch it until it ends (as supervise_task). Called again, it finds what it started."""
        await self._start(input.start)
        ref = input.start.ref
        return await self._watch(ref, input.settings, input.readiness, TaskReport(**ref.ids(), started=True))

    async def _start(self, input: StartTaskInput) -> tuple[list[int], bool]:
        key = task_key(input.ref)
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
                gpus, started = await self._starter.ready(key, input.group, env, _beat, reported)
            else:
                gpus = await self._starter.start(key, input.group, env, _beat, reported, input.host_network)
                started = True
        except SetupEnded as ended:
            raise ApplicationError(ended.reason.text, type=ended.reason.code, non_retryable=True) from None
        return gpus, started

    @activity.defn(name="supervise_task")
    async def supervise_task(self, input: SuperviseInput) -> TaskExit:
        """Report the worker running, then watch it until it ends, heartbeating all along; with a readiness
        check, report its health to the run whenever it changes. A supervisor that re-attached after a missed
        heartbeat says it is heard again."""
        report = TaskReport(**input.ref.ids(), heartbeat=input.reattach)
        return await self._watch(input.ref, input.settings, input.readiness, report)

    async def _watch(
        self, ref: TaskRef, settings: Settings, readiness: Readiness | None, report: TaskReport
    ) -> TaskExit:
        key = task_key(ref)
        self._attempts.add(key)
        observed = await asyncio.to_thread(self._runtime.observe, key)
        if observed.not_found:
            return TaskExit(not_found=True)
        await self._client.get_workflow_handle(job_id(ref.namespace, ref.job)).signal("task_running", report)
        checking = None
        if readiness is not None:
            checking = asyncio.ensure_future(self._check_health(ref, readiness))
        settled_at = time.monotonic() + SETTLED_AFTER_SECONDS
        heartbeat = settings.stale_grace_seconds / 4  # heartbeats well within the grace
        settled = min(POLL_SECONDS_SETTLED, heartbeat)
        ended = self._runtime.ended_fd(key)  # a worker whose end wakes this watch needs no polling
        try:
            while observed.running:
                activity.heartbeat()
                if ended is not None:
                    await _readable(ended, heartbeat)
                else:
                    await asyncio.sleep(POLL_SECONDS if time.monotonic() < settled_at else settled)
                observed = await asyncio.to_thread(self._runtime.observe, key)
        finally:
            if ended is not None:
                os.close(ended)
            if checking is not None:
                checking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checking
        if observed.not_found:
            return TaskExit(not_found=True)
        tail = await asyncio.to_thread(self._runtime.log_tail, key, settings.log_tail_lines, settings.log_tail_bytes)
        return TaskExit(exit_code=observed.exit_code, oom=observed.oom, log_tail=tail)

    @activity.defn(name="stop_task")
    async def stop_task(self, input: StopTaskInput) -> None:
        """The stop signal, the grace period, then a kill; returns once the worker has ended. A worker still
        being set up stops there."""
        key = task_key(input.ref)
        await _heartbeating(self._starter.stop(key, input.grace_seconds))

    async def stop_own_workers(self, grace_seconds: float) -> int:
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

    @activity.defn(name="read_log")
    async def read_log(self, input: ReadLogInput) -> LogText:
        """An attempt's output (stdout and stderr), the last `max_bytes` of it, for `astraeus logs`."""
        key = task_key(input.ref)
        text = await asyncio.to_thread(self._runtime.log_tail, key, input.lines, input.max_bytes)
        return LogText(text=text)

    async def _check_health(self, ref: TaskRef, readiness: Readiness) -> None:
        """Every period, run the readiness check on a thread (a slow check never delays a heartbeat) and signal
        `task_health` when its outcome changes; the first outcome is always told. Runs until cancelled."""
        key = task_key(ref)
        handle = self._client.get_workflow_handle(job_id(ref.namespace, ref.job))
        told: bool | None = None
        while True:
            began = time.monotonic()
            try:
                healthy, detail = await asyncio.to_thread(self._runtime.probe, key, readiness)
            except Exception as err:  # the runtime could not run the check (the engine does not answer)
                healthy, detail = False, f"the check could not run: {err}"
            if healthy != told:
                report = TaskHealthReport(task_id=ref.task_id, attempt=ref.attempt, healthy=healthy, detail=detail)
                try:
                    await handle.signal("task_health", report)
                    told = healthy
                except Exception as err:  # told at the next check
                    log.warning("%s: could not report its health: %s", key.slug, err)
            await asyncio.sleep(max(0.0, readiness.period_seconds - (time.monotonic() - began)))

    async def _report_progress(self, key: TaskKey, reason: Reason) -> None:
        """Tell the run what its worker waits for while it is set up, or that its image is being pulled."""
        report = TaskProgressReport(
            task_id=key.task,
            attempt=key.attempt,
            pulling=reason.code == R.Pulling.code,
            code=reason.code,
            reason=reason.text,
        )
        await self._client.get_workflow_handle(job_id(key.namespace, key.job)).signal("task_progress", report)

    async def _report_gpu_health(self) -> None:
        """Tell the machine's workflow when a GPU faults or becomes at risk (update `report_gpus`)."""
        if self._gpu_watch is None:
            return
        gpus: list[GpuInfo] = await asyncio.to_thread(self._gpu_watch.poll)
        if gpus == self._gpus:
            return
        handle = self._client.get_workflow_handle(node_id(self._inventory.name))
        try:
            await handle.execute_update("report_gpus", GpuHealthReport(gpus=gpus))
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
            read = self._pressure_read = asyncio.ensure_future(asyncio.to_thread(self._pressure_watch.poll))
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
            await handle.execute_update("report_pressure", PressureReport(pressure=pressure))
        except Exception as err:  # told again at the next look
            log.warning("%s: could not report its pressure: %s", self._inventory.name, err)
            return
        self._pressure = pressure

    # ---- orphans: workers whose run's workflow is no longer open ------------------------------------------------

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

    async def _stop_orphans(self) -> None:
        """Stop every worker that runs here while its run's workflow is closed, terminated (the Temporal UI's
        Terminate button) or gone: nothing else would ever stop it. Each stop is written in the machine's history.
        A run whose workflow cannot be read now (Temporal does not answer) is looked at again next time."""
        try:
            running = await asyncio.to_thread(self._runtime.running)
        except Exception as err:  # the engine does not answer: look again next time
            log.warning("%s: could not list its workers: %s", self._inventory.name, err)
            return
        for namespace, job in sorted({(key.namespace, key.job) for key in running}):
            try:
                status = await self._closed_run(namespace, job)
            except Exception as err:
                log.warning("%s: could not read run %s/%s: %s", self._inventory.name, namespace, job, err)
                continue
            if status is None:
                continue
            for key in (key for key in running if (key.namespace, key.job) == (namespace, job)):
                log.warning("%s: stopping %s: its run is no longer open (%s)", self._inventory.name, key.slug, status)
                try:
                    await self._starter.stop(key, self._settings.stop_grace_seconds)
                except Exception as err:  # tried again at the next look, since it still runs
                    log.warning("%s: could not stop %s: %s", self._inventory.name, key.slug, err)
                    continue
                self._orphans_untold.append(OrphanStoppedReport(task=key.task, run=f"{namespace}/{job}", status=status))
        await self._tell_orphans_stopped()

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
                await handle.execute_update("report_orphan_stopped", self._orphans_untold[0])
            except Exception as err:
                log.warning("%s: could not write a stopped orphan in its history: %s", self._inventory.name, err)
                return
            self._orphans_untold.pop(0)


def _beat(doing: str) -> None:
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


async def _readable(fd: int, seconds: float) -> None:
    """Wait until `fd` is readable or `seconds` passed, whichever comes first."""
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
