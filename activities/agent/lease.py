"""The machine's lease as its agent holds it: registration with the machine's workflow, the lease activity that renews
it by heartbeating, what tells that it was lost (expired while the agent was away, or taken over by another agent),
the fence (an agent whose renewals Temporal has not recorded for `Settings.fence_seconds` stops its workers, since
its machine is lost and their runs start them elsewhere once that fence passed: workflows/domain/machine/fence.py),
and the reports that ride beside it (the GPUs' health, the machine's pressure, its data location)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities.agent.drives import DriveActivities
from activities.agent.gpus import GpuWatch
from activities.agent.machine import PressureWatch
from activities.instances import gone
from workflows import contracts
from workflows.contracts import CONTROL_TASK_QUEUE, node_id
from workflows.domain.inventory import GpuInfo, NodeInventory, NodeView
from workflows.domain.machine.decisions import GpusReported, PressureReported, Registered
from workflows.domain.settings import Settings
from workflows.messages import LeaseInput, NodeInput
from workflows.node import NodeWorkflow

log = logging.getLogger(__name__)

EXPIRED = "its lease expired"  # why a lease was lost: this agent registers again
TAKEN_OVER = "its lease was taken over"  # another agent holds the machine: this one stops its workers and ends
GPU_HEALTH_SECONDS = 5.0  # how often the lease's holder looks at the GPUs' health (and the machine's pressure)
PRESSURE_READ_SECONDS = 1.0  # a pressure read still going after this is collected at a later look
PAUSE_FLOOR_SECONDS = 5.0  # a lease's loop unheard for this long (at least) counts the lease lost: it was paused
REGISTER_RETRY_SECONDS = 60.0  # how long a registration the machine's workflow did not process is tried again
FENCE_LOOK_SECONDS = 1.0  # how often the fence is looked at (at most: a tenth of the fence when that is shorter)


class RegistrationRefused(Exception):
    """The machine's workflow refused this agent (another live agent holds the machine); the message says why."""


class LeaseLost(Exception):
    """The agent lost its machine's lease (it expired while the agent was away, or another agent took over): it
    stopped its workers and ends; the message says why."""


async def register(client: Client, node: NodeInventory, settings: Settings, instance: str = "") -> NodeView:
    """Start the machine's NodeWorkflow if it is new, and register this agent with it. An agent of this host that
    is gone (killed, crashed) is taken over at once; a live one, or one of another host, refuses this agent until
    its lease expires."""
    handle = await client.start_workflow(
        NodeWorkflow.run,
        NodeInput(name=node.name, settings=settings),
        id=node_id(node.name),
        task_queue=CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    request = Registered(inventory=node, instance=instance)
    deadline, pause = time.monotonic() + REGISTER_RETRY_SECONDS, 0.5
    while True:
        try:
            return await handle.execute_update(NodeWorkflow.register, request)
        except WorkflowUpdateFailedError as error:
            cause = error.cause
            if _unprocessed(cause) and time.monotonic() < deadline:
                # The machine's workflow did not get to it (its task failed or timed out on a busy control plane).
                log.warning("%s: registration not processed, trying again in %.1f s: %s", node.name, pause, cause)
                await asyncio.sleep(pause)
                pause = min(2 * pause, 5.0)
                continue
            holder = str(cause.details[0]) if isinstance(cause, ApplicationError) and cause.details else ""
            if request.take_over or not (isinstance(cause, ApplicationError) and cause.type == "LeaseHeld"):
                raise RegistrationRefused(f"machine {node.name} could not register: {cause}") from None
            if not gone(holder):
                raise RegistrationRefused(str(cause.message)) from None
            log.info("%s: its agent %s is gone: taking the machine over", node.name, holder)
            request = request.model_copy(update={"take_over": holder})


def _unprocessed(cause: BaseException) -> bool:
    """Whether an update failed because the workflow never processed it (not a refusal): worth trying again."""
    return (isinstance(cause, ApplicationError) and cause.type == "UnprocessedUpdate") or (
        "UnprocessedUpdate" in str(cause)
    )


class Lease:
    """The machine's lease as this agent holds it, and what it reports beside it. `looks` runs at each look of the
    lease's loop (twice per renewal): the housekeeping that must never hold up a renewal starts its work there."""

    def __init__(
        self,
        client: Client,
        inventory: NodeInventory,
        drives: DriveActivities,
        settings: Settings,
        instance: str,
        looks: Callable[[], None],
        gpu_watch: GpuWatch | None = None,
        pressure_watch: PressureWatch | None = None,
    ) -> None:
        self._client = client
        self._inventory = inventory
        self.node_name = inventory.name
        self._drives = drives
        self._settings = settings
        self.instance = instance  # this agent process ("host:pid:token"), as its machine's lease names it
        self._looks = looks
        self.lost = asyncio.Event()  # set once its lease is lost: the agent then stops its workers and exits
        self.lost_why = ""
        self.gpus = list(inventory.gpus)  # with their health as last reported to the machine's workflow
        self._gpu_watch = gpu_watch
        self._pressure_watch = pressure_watch
        self._pressure = list(inventory.pressure)  # as last reported to the machine's workflow
        self._pressure_read: asyncio.Future[list[str]] | None = None
        self.registered_at: datetime | None = None  # when the machine's workflow took this agent's latest registration
        self.registrations = 0  # how often this agent registered: a start begun before the latest one is fenced
        self._seen = time.monotonic()  # when hold_lease last ran here
        self._leases = 0  # hold_lease activities begun here: a newer one carries the lease of a run continued as new
        # The latest renewal Temporal recorded (its time, read back from the machine's workflow) or registration it
        # took: the fence is counted from it. On the server's clock, compared with this machine's (the skew).
        self.confirmed = datetime.now(UTC)
        self._confirming: asyncio.Task[None] | None = None
        self._confirm_due = 0.0  # time.monotonic() from which the next renewal is read back
        self.fenced = False  # it stopped its workers at its fence; cleared when it registers again

    def took(self, view: NodeView) -> None:
        """The machine's workflow took this agent's registration (its first, or again after its lease expired)."""
        self.registered_at = view.since
        self.registrations += 1
        self.lost_why = ""
        self.lost.clear()
        self._seen = time.monotonic()
        self.confirmed = max(self.confirmed, datetime.now(UTC))
        self.fenced = False

    def inventory(self) -> NodeInventory:
        """What the machine has, with its GPUs' health and its pressure as last seen: what it registers again."""
        data = self._drives.store.report()
        return self._inventory.model_copy(
            update={"gpus": list(self.gpus), "pressure": list(self._pressure), **dict(data)}
        )

    def idle_seconds(self) -> float:
        """How long no lease was held here: long past its TTL, the machine's workflow holds none for this agent."""
        return time.monotonic() - self._seen

    # ---- fencing: what the lease says of a start -----------------------------------------------------------------

    def doubtful(self, info: activity.Info) -> bool:
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
            or self.fenced
        )

    def changed(self, began: float, registrations: int) -> bool:
        """Whether, since a start began, a lease's time passed (it waited to be set up, or this agent was paused)
        or this agent's lease was lost or taken again: its run may have moved on."""
        elapsed = time.monotonic() - began
        return (
            elapsed > self._settings.node_lease_ttl_seconds or self.registrations != registrations or self.lost.is_set()
        )

    # ---- the lease activity ----------------------------------------------------------------------------------

    async def hold(self, input: LeaseInput) -> None:
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
                self._seen = now
                if now >= due - period / 2:
                    renewed, due = now, now + input.renew_seconds
                    # With its time: a lease whose expiry reaches its workflow late (the cluster was away) is told
                    # from one that went unrenewed (NodeWorkflow's probation).
                    activity.heartbeat(datetime.now(UTC).isoformat())
                    self._confirm(node_id(self.node_name), input.renew_seconds)
                self._looks()
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
            if self._confirming is not None:
                self._confirming.cancel()

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

    # ---- the fence --------------------------------------------------------------------------------------------

    def _confirm(self, workflow_id: str, renew_seconds: float) -> None:
        """Read back, beside the lease's loop, when Temporal last recorded its renewal (the lease activity's last
        heartbeat, as the machine's workflow describes it): what the fence counts from. Asked a moment after the
        renewal, which the SDK sends within its throttle (1 s); at most once a third of a lease (a describe is a read
        of the server's: renewals come every third of the stale grace), so the fence may count from a renewal up to
        that much older than the latest, and stop the workers that much sooner, never later."""
        now = time.monotonic()
        if now < self._confirm_due or (self._confirming is not None and not self._confirming.done()):
            return
        self._confirm_due = now + self._settings.node_lease_ttl_seconds / 3
        self._confirming = asyncio.ensure_future(self._read_renewal(workflow_id, min(1.5, renew_seconds / 2)))

    async def _read_renewal(self, workflow_id: str, after: float) -> None:
        await asyncio.sleep(after)
        try:
            described = await self._client.get_workflow_handle(workflow_id).describe()
        except Exception as err:  # unheard: the fence counts on from the last one read
            log.warning(
                "%s: could not read back its lease's renewal (%s): %.0f s of its fence (%g s) gone",
                self.node_name, err, self.unheard_seconds(), self._settings.fence_seconds,
            )  # fmt: skip
            return
        for pending in described.raw_description.pending_activities:
            if pending.activity_type.name == contracts.activity_name(contracts.hold_lease) and pending.HasField(
                "last_heartbeat_time"
            ):
                self.confirmed = max(self.confirmed, pending.last_heartbeat_time.ToDatetime(tzinfo=UTC))

    def unheard_seconds(self) -> float:
        """How long ago Temporal last recorded a renewal of this machine's lease (or took its registration)."""
        return (datetime.now(UTC) - self.confirmed).total_seconds()

    async def keep_fence(self, stop_workers: Callable[[], Awaitable[int]]) -> None:
        """Runs as long as the agent: once Temporal has recorded no renewal for the fence, stop every worker of the
        machine (`stop_workers`). Its lease expired long before (the fence is longer than a lease): its runs count
        the machine lost and start these workers elsewhere once the fence has surely passed, so no worker runs
        twice. It takes no work until it registers again; a worker stopped here that its run still had (Temporal was
        away longer than the fence) ends as its stop made it end."""
        fence = self._settings.fence_seconds
        while True:
            await asyncio.sleep(min(FENCE_LOOK_SECONDS, fence / 10))
            if self.fenced or self.unheard_seconds() <= fence:
                continue
            self.fenced = True
            log.warning(
                "%s: no renewal of its lease recorded by Temporal for %.0f s (its fence, %g s): stopping its workers",
                self.node_name, self.unheard_seconds(), fence,
            )  # fmt: skip
            stopped = await stop_workers()
            log.warning("%s: stopped %d worker(s) at its fence", self.node_name, stopped)

    # ---- reports beside the lease ----------------------------------------------------------------------------

    async def _keep_reporting(self, period: float) -> None:
        """Tell the machine's workflow the GPUs' health, the machine's pressure and its data location when they
        change, on a loop of their own beside the lease's: each report is an update that waits for the machine's
        workflow task, which a burst of runs can hold up for many seconds, and a renewal must never wait for it (in a
        500-run burst two machines lost their leases while these reports were awaited between renewals)."""
        while True:
            for report in (self._report_gpu_health, self._report_pressure, self._drives.report):
                try:
                    await report()
                except Exception:  # told again at the next look
                    log.exception("%s: a report to the machine's workflow failed", self.node_name)
            await asyncio.sleep(period)

    async def _report_gpu_health(self) -> None:
        """Tell the machine's workflow when a GPU faults or becomes at risk (update `report_gpus`)."""
        if self._gpu_watch is None:
            return
        gpus: list[GpuInfo] = await asyncio.to_thread(self._gpu_watch.poll)
        if gpus == self.gpus:
            return
        handle = self._client.get_workflow_handle(node_id(self.node_name))
        try:
            await contracts.update(handle, contracts.REPORT_GPUS, GpusReported(gpus=gpus))
        except Exception as err:  # told again at the next look
            log.warning("%s: could not report the GPUs' health: %s", self.node_name, err)
            return
        self.gpus = gpus

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
            log.warning("%s: could not read its pressure: %s", self.node_name, err)
            return
        if pressure == self._pressure:
            return
        handle = self._client.get_workflow_handle(node_id(self.node_name))
        try:
            await contracts.update(handle, contracts.REPORT_PRESSURE, PressureReported(pressure=pressure))
        except Exception as err:  # told again at the next look
            log.warning("%s: could not report its pressure: %s", self.node_name, err)
            return
        self._pressure = pressure
