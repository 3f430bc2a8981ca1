"""An agent's attempts: start one (admitted within the machine's real free GPUs, prepared, its image pulled,
started), tell its run it was picked up, started and runs, watch it until it ends (heartbeating, and checking its
readiness), and remember in the machine's record what each activity did with it.

Every activity is idempotent: an attempt's container is named by run, worker and attempt, so a retried start
finds its own, and a watch that restarts re-attaches to a worker that kept running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TypeVar

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from activities.agent.housekeeping import RETURNED_KEPT_SECONDS, WATCHED_RUN_LOOKS
from activities.agent.lease import Lease
from activities.agent.runtime.base import Held, Observed, Runtime, readable
from activities.agent.starter import SetupEnded, Starter
from workflows import contracts
from workflows.domain.group_parts import Readiness
from workflows.domain.inventory import NodeInventory
from workflows.domain.machine.attempts import Attempts
from workflows.domain.reasons import R, Reason
from workflows.domain.refs import TaskRef
from workflows.domain.run.events import TaskHealth, TaskProgress, TaskRunning
from workflows.domain.settings import Settings
from workflows.domain.spec import job_id
from workflows.messages import StartTaskInput, TaskExit

log = logging.getLogger(__name__)

T = TypeVar("T")
M = TypeVar("M")
# A worker is looked at often while young (short workers end soon, and their run waits for that), then once a
# second: a machine with hundreds of long workers must not spend its CPU asking each of them four times a second.
POLL_SECONDS = 0.25
POLL_SECONDS_SETTLED = 1.0
SETTLED_AFTER_SECONDS = 5.0
# A worker whose setting up takes longer than this is told to its run as picked up (Preparing) while it lasts; a
# quicker one is told once, started and running, with when it was picked up and started (no signal more).
PICK_UP_REPORT_SECONDS = 1.0


class Supervisor:
    def __init__(
        self,
        client: Client,
        inventory: NodeInventory,
        runtime: Runtime,
        attempts: Attempts,
        lease: Lease,
        fence: Callable[[TaskRef], Awaitable[None]],
        settings: Settings,
    ) -> None:
        self._client = client
        self._inventory = inventory
        self.node_name = inventory.name
        self._runtime = runtime
        self._attempts = attempts
        self._lease = lease
        self._fence = fence  # refuses a start whose attempt its run no longer has here (Housekeeping.fence)
        self._settings = settings
        self.starter: Starter | None = None  # set by the agent, which makes the starter with `report_progress`
        self._watches: dict[TaskRef, asyncio.Event] = {}  # each attempt's current watch, set when a newer one begins

    @property
    def _starter(self) -> Starter:
        assert self.starter is not None
        return self.starter

    async def external(self, ref: TaskRef) -> dict[str, str]:
        """Where people reach the attempt's external access: this machine's address and the ports it holds."""
        held = await asyncio.to_thread(self._runtime.ports_in_use)
        return {name: f"{self._inventory.address}:{port}" for name, port in sorted(held.get(ref.slug, {}).items())}

    async def start(
        self, input: StartTaskInput, settings: Settings | None = None
    ) -> tuple[list[int], bool, datetime, str | None]:
        """Its GPUs, whether it started, when this agent picked it up, and at the barrier the address held for it on
        the node network. A setup that takes longer than PICK_UP_REPORT_SECONDS with nothing else told is told to
        the run as picked up while it lasts."""
        ref = input.ref
        _beat_later(settings or self._settings)
        picked_up = datetime.now(UTC)
        self._attempts.picked_up(ref, picked_up)
        teller = asyncio.ensure_future(self._tell_picked_up(ref))
        try:
            gpus, started, held = await self._admit_and_start(input, ref)
        finally:
            teller.cancel()
            self._attempts.setup_over(ref)
        return gpus, started, picked_up, held

    async def _tell_picked_up(self, ref: TaskRef) -> None:
        await asyncio.sleep(PICK_UP_REPORT_SECONDS)
        attempt = self._attempts.get(ref)
        if attempt is not None and attempt.told_setting_up:
            return  # a wait or a pull was told: the run shows it picked up already
        try:
            await self.report_progress(ref, R.PickedUp(node=self.node_name))
        except Exception as err:  # the report of its start says it later
            log.warning("%s: could not tell its run it was picked up: %s", ref.slug, err)

    async def _admit_and_start(self, input: StartTaskInput, ref: TaskRef) -> tuple[list[int], bool, str | None]:
        began, registrations = time.monotonic(), self._lease.registrations
        details = activity.info().heartbeat_details
        _beat(str(details[0]) if details else "starting")  # a start that queues is not a dead agent
        if self._lease.doubtful(activity.info()):
            await self._fence(input.ref)

        async def fence() -> None:
            """Just before the runtime starts it: ask again if it took a lease's time, or the lease changed."""
            if self._lease.changed(began, registrations):
                await self._fence(input.ref)

        with self.live(ref):
            return await self._set_up_and_start(input, ref, fence)

    async def _set_up_and_start(
        self, input: StartTaskInput, ref: TaskRef, fence: Callable[[], Awaitable[None]]
    ) -> tuple[list[int], bool, str | None]:
        self._attempts.ours(ref)
        env = {
            **input.group.env,
            **input.env,
            "ASTRAEUS_NODE": self.node_name,
            "ASTRAEUS_GROUP": input.group.name,
        }
        details = activity.info().heartbeat_details
        reported = str(details[0]) if details else None
        try:
            if input.barrier:
                return await self._starter.ready(ref, input.group, env, _beat, reported)
            gpus = await self._starter.start(ref, input.group, env, _beat, reported, input.host_network, fence)
        except SetupEnded as ended:
            raise ApplicationError(ended.reason.text, type=ended.reason.code, non_retryable=True) from None
        return gpus, True, None

    async def watch(
        self, ref: TaskRef, settings: Settings, readiness: Readiness | None, report: TaskRunning
    ) -> TaskExit:
        """Watch the attempt until it ends: its exit. One watch per attempt: a newer one (its run continued as new, or
        attached its watch again) ends this one, whose activity its run no longer awaits."""
        self._attempts.watch_began(ref)
        registrations = self._lease.registrations
        newer = self._take_watch(ref)
        with self.live(ref):
            try:
                ended, paused = await _unless(newer, self._watch_attempt(ref, settings, readiness, report))
            except _Superseded:
                raise ApplicationError(
                    f"{ref.slug}: a newer watch took over", type="Superseded", non_retryable=True
                ) from None
            except BaseException:
                # Cancelled (its run lost it with the machine, say) or failed: should it exit 0 on its own, its run
                # is told at a later look for orphans, so finished work is not run again.
                self._attempts.unwatched(ref)
                raise
            finally:
                if self._watches.get(ref) is newer:
                    del self._watches[ref]
        if paused > self._settings.node_lease_ttl_seconds or self._lease.changed(time.monotonic(), registrations):
            self._attempts.unwatched(ref)  # this result may reach no one: its run is told again at a later look
        else:
            self._attempts.returned(ref, time.monotonic(), RETURNED_KEPT_SECONDS)
        return ended

    def _take_watch(self, ref: TaskRef) -> asyncio.Event:
        """This watch is the attempt's: the one before (if any) ends. The event is set once a newer one comes."""
        before = self._watches.get(ref)
        if before is not None:
            before.set()
        newer = self._watches[ref] = asyncio.Event()
        return newer

    async def _watch_attempt(
        self, ref: TaskRef, settings: Settings, readiness: Readiness | None, report: TaskRunning
    ) -> tuple[TaskExit, float]:
        """Its exit, and the longest this agent went unheard while watching it (paused, say)."""
        self._attempts.watch_began(ref)
        ended = self._runtime.ended_fd(ref)  # a worker whose end wakes this watch needs no polling
        checking = None
        try:
            # Nor a look while that end has not come: no thread is asked to look at a worker just started.
            if ended is not None and not readable(ended, 0):
                observed = Observed(running=True)
            else:
                observed = await asyncio.to_thread(self._runtime.observe, ref)
            if observed.not_found:
                return TaskExit(not_found=True), 0.0
            await self._tell_run(ref.namespace, ref.job, contracts.TASK_RUNNING, report)
            if readiness is not None:
                checking = asyncio.ensure_future(self._check_health(ref, readiness))
            settled_at = time.monotonic() + SETTLED_AFTER_SECONDS
            # Heartbeats well within the grace (runs from before protocol 7), and a look every orphan_check_seconds.
            # Without heartbeats a worker whose end wakes this watch is looked at once every WATCHED_RUN_LOOKS looks
            # only (a minute): its shim, unable to write its exit (a full disk), lives on holding it, which only a
            # look sees, and that look only says so in the log. Any wait that ran much longer than asked: this agent
            # was paused (`paused`, the longest).
            beats = _beats()
            every = heartbeat_seconds(settings) if beats else WATCHED_RUN_LOOKS * settings.orphan_check_seconds
            look_every = settings.orphan_check_seconds if beats else every
            settled = min(POLL_SECONDS_SETTLED, every)
            paused, look_at = 0.0, time.monotonic() + look_every
            while observed.running:
                if observed.held is not None and self._attempts.held_first_seen(ref):
                    _say_held(ref, observed.held)
                _beat()
                began = time.monotonic()
                if ended is None:
                    wait = POLL_SECONDS if began < settled_at else settled
                    await asyncio.sleep(wait)
                    observed = await asyncio.to_thread(self._runtime.observe, ref)
                else:
                    wait = max(0.0, min(every, look_at - began))
                    if await _readable(ended, wait) or time.monotonic() >= look_at:
                        observed = await asyncio.to_thread(self._runtime.observe, ref)
                        look_at = time.monotonic() + look_every
                paused = max(paused, time.monotonic() - began - wait)
        finally:
            if ended is not None:
                os.close(ended)
            if checking is not None:
                checking.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checking
        if observed.not_found:
            return TaskExit(not_found=True), paused
        tail = await asyncio.to_thread(self._runtime.log_tail, ref, settings.log_tail_lines, settings.log_tail_bytes)
        return TaskExit(exit_code=observed.exit_code, oom=observed.oom, log_tail=tail), paused

    async def _check_health(self, ref: TaskRef, readiness: Readiness) -> None:
        """Every period, run the readiness check on a thread (a slow check never delays a heartbeat) and signal
        `task_health` when its outcome changes; the first outcome is always told. Runs until cancelled."""
        told: bool | None = None
        while True:
            began = time.monotonic()
            try:
                healthy, detail = await asyncio.to_thread(self._runtime.probe, ref, readiness)
            except Exception as err:  # the runtime could not run the check (the engine does not answer)
                healthy, detail = False, f"the check could not run: {err}"
            if healthy != told:
                report = TaskHealth(task_id=ref.task_id, attempt=ref.attempt, healthy=healthy, detail=detail)
                try:
                    await self._tell_run(ref.namespace, ref.job, contracts.TASK_HEALTH, report)
                    told = healthy
                except Exception as err:  # told at the next check
                    log.warning("%s: could not report its health: %s", ref.slug, err)
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

    async def report_progress(self, ref: TaskRef, reason: Reason) -> None:
        """Tell the run what its worker waits for while it is set up, or that its image is being pulled, or that
        it was picked up (and when: the run shows it Preparing since then)."""
        self._attempts.told_setting_up(ref)
        attempt = self._attempts.get(ref)
        report = TaskProgress(
            task_id=ref.task_id,
            attempt=ref.attempt,
            pulling=reason.code == R.Pulling.code,
            reason=reason,
            picked_up_at=attempt.picked_up_at if attempt is not None else None,
        )
        await self._tell_run(ref.namespace, ref.job, contracts.TASK_PROGRESS, report)

    @contextlib.contextmanager
    def live(self, ref: TaskRef) -> Iterator[None]:
        """While an activity starts or watches the attempt, its run has it: the look for stale attempts skips it."""
        self._attempts.activity_began(ref)
        try:
            yield
        finally:
            self._attempts.activity_ended(ref)


# When an attempt's activity may send its first heartbeat (time.monotonic()). The SDK sends an activity's first
# heartbeat at once, then one per throttle interval: beating from the first moment cost a burst one write per worker
# at its start, when the server can least afford it, and one interval in, 1.7 writes per run in a burst of 500
# (bench/README.md). Two intervals in (half the stale grace), 0.7 on a fast day and 1.5 on a slow one, a fifth of
# the server's writes. Three intervals in leaves a quarter of the grace for it to arrive, more than the SDK leaves
# each later one (it sends them at most every 0.8 of the heartbeat timeout, the grace).
_first_beat_at: ContextVar[float] = ContextVar("first_beat_at", default=0.0)
FIRST_BEAT_INTERVALS = 3


def _say_held(ref: TaskRef, held: Held) -> None:
    """The agent's log says why an attempt that ended still reads running: its shim holds what it cannot write."""
    did = "started" if held.record == "pid" else "exited"
    log.warning(
        "%s: %s %s but its %s cannot be written to %s (filesystem %s): %s; kept until there is room",
        ref.slug, ref.task_id, did, held.record, held.directory, held.filesystem, held.error,
    )  # fmt: skip


def heartbeat_seconds(settings: Settings) -> float:
    """How often a worker's watch heartbeats: well within the stale grace, and within a lease."""
    return min(settings.stale_grace_seconds, settings.node_lease_ttl_seconds) / 4


def _beat_later(settings: Settings) -> None:
    """This activity's first heartbeat waits FIRST_BEAT_INTERVALS heartbeat intervals (`_first_beat_at`)."""
    _first_beat_at.set(time.monotonic() + FIRST_BEAT_INTERVALS * heartbeat_seconds(settings))


def _beats() -> bool:
    """Whether this activity heartbeats: a run's watch of its worker does only for runs from before protocol 7, which
    gave it a heartbeat timeout. Since, the machine's lease carries its workers' liveness (one renewal per machine,
    workflows/domain/machine/liveness.py) and a watch reports its worker's start and end only."""
    return activity.info().heartbeat_timeout is not None


def _beat(doing: str | None = None) -> None:
    """Heartbeat (with what the attempt is doing, for a retry to read), unless its activity began less than
    FIRST_BEAT_INTERVALS heartbeat intervals ago, or it has no heartbeat timeout."""
    if time.monotonic() < _first_beat_at.get() or not _beats():
        return
    if doing is None:
        activity.heartbeat()
    else:
        activity.heartbeat(doing)


class _Superseded(Exception):
    """A newer watch of the attempt took over."""


async def _unless(newer: asyncio.Event, work: Awaitable[T]) -> T:
    """Await `work`, unless `newer` is set first: then `work` is cancelled and _Superseded raised."""
    working = asyncio.ensure_future(work)
    waiting = asyncio.ensure_future(newer.wait())
    try:
        await asyncio.wait([working, waiting], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
        if not working.done():
            working.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await working
    if working.cancelled() and newer.is_set():
        raise _Superseded()
    return working.result()


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
