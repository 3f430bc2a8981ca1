"""The three long-running processes: control plane, scheduler and node agent, each a Temporal worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.worker import PollerBehaviorSimpleMaximum, UnsandboxedWorkflowRunner, Worker
from temporalio.worker._worker import load_default_build_id  # the SDK's default build, not exported

from activities.agent import AgentActivities
from activities.control import DEFAULT_CA_DIR, ControlActivities
from activities.scheduler import SchedulerService
from activities.scheduler_lease import LeaseHeld, SchedulerLeaseHolder
from activities.scheduler_link import DEFAULT_ADDRESS, SchedulerDoor, SchedulerLink
from workflows.contracts import (
    CONTROL_TASK_QUEUE,
    SCHEDULER_TASK_QUEUE,
    lease_task_queue,
    node_task_queue,
    scheduler_lease_task_queue,
)
from workflows.deleted_runs import DeletedRunsWorkflow
from workflows.deletion import DeleteRunWorkflow
from workflows.domain.settings import Settings
from workflows.drives import DrivesWorkflow
from workflows.identity import IdentityWorkflow
from workflows.job import JobWorkflow
from workflows.logs import LogsWorkflow
from workflows.node import NodeWorkflow
from workflows.quotas import QuotasWorkflow
from workflows.scheduler_lease import SchedulerLeaseWorkflow
from workflows.sessions import SessionWorkflow
from workflows.subnets import SubnetsWorkflow
from workflows.tokens import TokensWorkflow

log = logging.getLogger(__name__)

# A lease's renewals reach the server when they are made (the SDK's default sends a heartbeat at most every 0.8 x its
# timeout): a machine's and the scheduler's.
LEASE_HEARTBEAT_THROTTLE = timedelta(seconds=1)


# The control plane runs the workflows outside the SDK's sandbox. Inside it, with the workflows' modules passed
# through it (importing them again for every run cost 13 ms of CPU per run), each activation still entered and left
# the sandbox, and so did each payload the SDK converted on the way in and out: a quarter of this process's CPU in a
# burst of 500 (py-spy), 14 ms per run against 10 without it, and the burst's workflow tasks waited behind it
# (bench/README.md). What the sandbox refused at run time is refused before: tests/test_workflow_code.py reads every
# workflow module for a clock, randomness or I/O, the workflow tests run the same workflows in the full sandbox (the
# SDK's default runner, tests/workflows/fakes.py), and the replay tests replay committed histories in it.
WORKFLOW_RUNNER = UnsandboxedWorkflowRunner()

# How the control plane's worker takes workflow tasks. A run's first task comes from the shared queue, its others
# from this worker's sticky queue. The SDK's default (5 pollers, one in six on the shared queue) took a burst's
# first tasks one poll round trip at a time: 200 runs waited a median of 17 s for their first task. 50 pollers took
# them sooner, but then some tasks the server handed to them never reached this worker and timed out (10 s each, for
# 2 to 8% of a burst's runs). 10 pollers shared evenly left 5 on the sticky queue: in a burst of 500 the runs' next
# tasks (the agent's report) waited a median of 9 s there and 200 to 430 of them passed the sticky queue's 10 s,
# went back to the shared queue and were replayed whole. 20 pollers, at most a quarter of them (5) on the shared
# queue, keep that wait under a second, with no timeout, and take first tasks as fast (bench/README.md). A run
# cached stays cached: 4,000 runs and machines fit. A run's first task runs its local activities (load_settings,
# place) while it holds its slot: as many of those as tasks.
WORKFLOW_TASK_OPTIONS: dict[str, Any] = {
    "max_concurrent_workflow_tasks": 200,
    "max_concurrent_local_activities": 200,
    "workflow_task_poller_behavior": PollerBehaviorSimpleMaximum(maximum=20),
    "nonsticky_to_sticky_poll_ratio": 0.25,
    "max_cached_workflows": 4000,
}


@dataclass(frozen=True)
class Serves:
    """What one Temporal worker of a process registers: its task queue, its workflows and its activities
    (tests/test_contracts.py checks them against every call the workflows make)."""

    task_queue: str
    workflows: list[type] = field(default_factory=list)
    activities: list[Callable[..., Any]] = field(default_factory=list)


def control_serves(control: ControlActivities, link: SchedulerLink) -> Serves:
    """The control plane: every workflow, their local activities, and the activity `machine_lost` for machines that
    called it here (the scheduler tells runs now)."""
    return Serves(
        CONTROL_TASK_QUEUE,
        [
            JobWorkflow,
            NodeWorkflow,
            LogsWorkflow,
            QuotasWorkflow,
            TokensWorkflow,
            DeleteRunWorkflow,
            DeletedRunsWorkflow,
            DrivesWorkflow,
            IdentityWorkflow,
            SessionWorkflow,
            SubnetsWorkflow,
            SchedulerLeaseWorkflow,
        ],
        [
            control.load_settings,
            control.issue_identity,
            control.tell_runs_machine_lost,
            control.cancel_run_workflow,
            link.place,
            link.release,
            control.end_run,
            control.forget_run,
        ],
    )


def scheduler_serves(service: SchedulerService) -> Serves:
    """The scheduler service; place and release for runs of protocols before 3."""
    return Serves(
        SCHEDULER_TASK_QUEUE,
        activities=[
            service.place,
            service.release,
            service.node_changed,
            service.quotas_changed,
            service.drives_changed,
            service.drive_users,
            service.plan_group,
            service.tell_runs_machine_lost,
            service.tell_runs_machine_heard,
        ],
    )


def machine_serves(activities: AgentActivities) -> Serves:
    """A node agent's machine queue: its workers' activities."""
    return Serves(
        node_task_queue(activities.node_name),
        activities=[
            activities.start_task,
            activities.run_task,
            activities.supervise_task,
            activities.stop_task,
            activities.read_log,
            activities.grant_session,
            activities.attach_session,
            activities.delete_run_files,
            activities.drives.use_data_location,
        ],
    )


def scheduler_lease_serves(lease: SchedulerLeaseHolder) -> Serves:
    """A scheduler process's own lease queue."""
    return Serves(scheduler_lease_task_queue(lease.instance), activities=[lease.hold])


def lease_serves(activities: AgentActivities) -> Serves:
    """A node agent's own lease queue."""
    return Serves(lease_task_queue(activities.node_name, activities.instance), activities=[activities.hold_lease])


def serving(client: Client, serves: Serves, **options: Any) -> Worker:
    """The Temporal worker that registers what `serves` says."""
    return Worker(
        client, task_queue=serves.task_queue, workflows=serves.workflows, activities=serves.activities, **options
    )


class ControlWorker:
    """The control plane's Temporal worker, hosting every JobWorkflow and NodeWorkflow, and its link to the
    scheduler's door at `scheduler` (HOST:PORT: the runs' `place` and `release`, as local activities; or the door
    itself, when the scheduler runs in this process), closed when the worker ends."""

    def __init__(
        self,
        client: Client,
        settings: Settings,
        scheduler: str | SchedulerDoor = DEFAULT_ADDRESS,
        ca_dir: Path = DEFAULT_CA_DIR,
    ) -> None:
        self.link = SchedulerLink(scheduler)
        control = ControlActivities(settings, client, ca_dir, scheduler=self.link)
        self.worker = serving(
            client, control_serves(control, self.link), workflow_runner=WORKFLOW_RUNNER, **WORKFLOW_TASK_OPTIONS
        )
        # The build the worker names in each task it completes: the SDK's default, a hash of the code this process
        # loaded, computed once per process (a client beside it lists it on the runs it starts: workers/client.py).
        self.build_id = load_default_build_id()

    async def run(self) -> None:
        try:
            await self.worker.run()
        finally:
            await self.link.close()

    async def shutdown(self) -> None:
        await self.worker.shutdown()


class SchedulerWorker:
    """A scheduler process: its lease's worker (on its own queue), its door, and, for each term it holds the lease,
    a view rebuilt from the durable truth with its Temporal worker (node_changed, quotas_changed, ...; place and
    release for runs of protocols before 3) and its sweep. A second scheduler waits as a standby: it polls no
    scheduler queue, its door refuses every call saying who holds the lease, and it claims the lease again every
    sixth of its TTL, taking over once the holder's lease expired. A scheduler that loses its lease (paused or cut off
    past its TTL, or taken over) places nothing from that moment: its door refuses, its worker stops, what it decided
    but did not send is dropped; when it holds the lease again it rebuilds its view and places again."""

    def __init__(
        self,
        client: Client,
        door: SchedulerDoor,
        lease: SchedulerLeaseHolder,
        new_service: Callable[[int], Awaitable[SchedulerService]] | None = None,
    ) -> None:
        self._client = client
        self.door = door
        self.lease = lease
        self._new_service = new_service or self._rebuilt
        self.service: SchedulerService | None = None  # the term's, while it holds the lease
        self.worker: Worker | None = None  # the term's worker on SCHEDULER_TASK_QUEUE
        self._lease_worker = serving(
            client,
            scheduler_lease_serves(lease),
            graceful_shutdown_timeout=timedelta(seconds=1),
            max_heartbeat_throttle_interval=LEASE_HEARTBEAT_THROTTLE,  # every renewal reaches the server when made
            default_heartbeat_throttle_interval=LEASE_HEARTBEAT_THROTTLE,
        )
        self._lease_running: asyncio.Future[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Poll the lease's queue and claim the lease; once granted, rebuild the view (before returning: the embedded
        default starts its machines after it). A fresh cluster's first claim is granted at once."""
        if self._lease_running is None:
            self._lease_running = asyncio.ensure_future(self._lease_worker.run())
        await self._begin_term()

    async def _rebuilt(self, epoch: int) -> SchedulerService:
        service = SchedulerService(self._client, epoch=epoch)
        await service.rebuild()
        return service

    async def _begin_term(self) -> bool:
        """Claim the lease and, once granted, rebuild a view for the term: True when it holds both. False while
        another scheduler holds the lease (its door says so) or Temporal does not answer."""
        try:
            granted = await self.lease.claim()
        except LeaseHeld as held:
            if self.door.refusal != str(held):
                log.warning("the scheduler waits as a standby: %s", held)
            self.door.refuse(str(held))
            return False
        except Exception as error:  # Temporal does not answer, or no control plane runs the lease's workflow yet
            log.warning("the scheduler could not claim its lease (tried again): %s", error)
            self.door.refuse(f"the scheduler could not claim its lease: {error}")
            return False
        epoch = granted.epoch
        log.warning("the scheduler %s holds the lease, epoch %d: rebuilding its view", self.lease.instance, epoch)
        self.door.refuse(f"the scheduler holds the lease (epoch {epoch}) and rebuilds its view")
        try:
            service = await self._new_service(epoch)
        except Exception:
            log.exception("the scheduler could not rebuild its view (epoch %d); it gives its term up", epoch)
            self.lease.lose("its view could not be rebuilt")
            return False
        if not self.lease.holds(epoch):
            service.stop(self.lease.why)
            return False
        self.service = service
        self.worker = serving(self._client, scheduler_serves(service), max_concurrent_activities=100)
        return True

    async def run(self) -> None:
        if self._lease_running is None:
            self._lease_running = asyncio.ensure_future(self._lease_worker.run())
        try:
            await self.door.listen()
            while not self._stopping.is_set():
                if self.service is None and not await self._begin_term():
                    await self._pause(self.lease.ttl / 6)
                    continue
                await self._serve_term()
        finally:
            await self._close()

    async def _close(self) -> None:
        """Stop polling the lease's queue, and close the door."""
        if self._lease_running is not None:
            with contextlib.suppress(Exception):
                await self._lease_worker.shutdown()
            with contextlib.suppress(BaseException):
                await self._lease_running
        await self.door.close()

    async def _serve_term(self) -> None:
        """Serve until the lease is lost or the process shuts down; then place nothing more."""
        service, worker = self.service, self.worker
        assert service is not None and worker is not None
        epoch = service.epoch
        service.sweeping = asyncio.ensure_future(service.sweep_forever())
        running = asyncio.ensure_future(worker.run())
        self.door.serve(service)
        try:
            while self.lease.holds(epoch) and not self._stopping.is_set() and not running.done():
                await self._pause(self.lease.ttl / 6, running)
        finally:
            why = self.lease.why or "the scheduler is shutting down"
            if not self.lease.holds(epoch) and not self.lease.lost.is_set():
                self.lease.lose(f"no renewal reached it for {self.lease.ttl:g} s")
                why = self.lease.why
            self.door.refuse(why)  # first: nothing is placed from here on
            service.stop(why)
            with contextlib.suppress(asyncio.CancelledError):
                await service.sweeping
            with contextlib.suppress(Exception):
                await worker.shutdown()
            self.service = self.worker = None
            await asyncio.gather(running, return_exceptions=True)
        if not self._stopping.is_set() and running.done() and not running.cancelled():
            running.result()  # the worker failed: the process ends, saying why

    async def _pause(self, seconds: float, *also: asyncio.Future[None]) -> None:
        """Wait `seconds`, or less when the lease is lost, the process shuts down, or one of `also` ends."""
        waits: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self.lease.lost.wait()),
            asyncio.ensure_future(self._stopping.wait()),
        ]
        try:
            await asyncio.wait([*waits, *also], timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def shutdown(self) -> None:
        self._stopping.set()
        if self.worker is not None:
            with contextlib.suppress(Exception):
                await self.worker.shutdown()


async def scheduler_worker(
    client: Client, door: SchedulerDoor | None = None, settings: Settings | None = None
) -> SchedulerWorker:
    """A scheduler process: it claims the scheduler's lease and, when granted, rebuilds its view from the durable
    truth before returning; then (run) it serves place / release at its door (default DEFAULT_ADDRESS, bound before
    the rebuild), node_changed and the others on its queue, and sweeps away runs that closed without giving their
    room back, for as long as it holds the lease. Refused the lease, it waits as a standby."""
    door = door or SchedulerDoor()
    scheduler = SchedulerWorker(client, door, SchedulerLeaseHolder(client, settings or Settings()))
    try:
        await scheduler.start()
    except BaseException:
        await scheduler._close()
        raise
    return scheduler
