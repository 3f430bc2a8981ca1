"""The node agent's activities: the facade of the agent's wing, which Temporal calls.

Each activity is a few lines handing its input to the part that does it: the machine's lease (`lease.py`), its
attempts (`attempts.py`: start, watch, report), and what is looked after beside them (`housekeeping.py`: adoption,
fencing, orphans, deleted runs). Every attempt the machine holds is one record of
`workflows/domain/machine/attempts.py`, shared by these parts and the starter.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime

from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.agent.attempts import Supervisor, _beat_later, _heartbeating
from activities.agent.capabilities import CapabilitySetup, Services
from activities.agent.drives import DriveActivities, DriveStore
from activities.agent.gpus import GpuWatch
from activities.agent.housekeeping import RETURNED_KEPT_SECONDS, Housekeeping
from activities.agent.identities import Identities
from activities.agent.lease import Lease
from activities.agent.machine import PressureWatch
from activities.agent.mesh import Mesh
from activities.agent.node_network import NodeNetwork
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import Runtime
from activities.agent.sessions import SessionRefused, Sessions
from activities.agent.starter import Starter
from workflows import contracts
from workflows.contracts import implements
from workflows.domain.inventory import NodeInventory, NodeView
from workflows.domain.machine.attempts import Attempts
from workflows.domain.refs import TaskRef
from workflows.domain.run.events import TaskRunning
from workflows.domain.settings import Settings
from workflows.messages import (
    Attached,
    AttachInput,
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
)

log = logging.getLogger(__name__)


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
        self.node_name = inventory.name
        self.instance = instance  # this agent process ("host:pid:token"), as its machine's lease names it
        self._runtime = runtime
        self._settings = settings or Settings()
        self._sessions = sessions
        self._attempts = Attempts()  # every attempt this machine holds, one record each
        if preparer.store is None:
            preparer.store = DriveStore(inventory.name)
        self.drives = DriveActivities(client, preparer.store)  # its data location and copies of drives
        self.node_network = NodeNetwork(client, inventory.name, runtime, mesh)
        self._lease = Lease(
            client, inventory, self.drives, self._settings, instance, lambda: self._housekeeping.look(),
            gpu_watch, pressure_watch,
        )  # fmt: skip
        self._supervisor = Supervisor(
            client, inventory, runtime, self._attempts, self._lease, lambda ref: self._housekeeping.fence(ref),
            self._settings,
        )  # fmt: skip
        capabilities = CapabilitySetup(services or Services(), inventory.capabilities, inventory.capability_notes)
        self._starter = Starter(
            runtime,
            preparer,
            lambda: self._lease.gpus,
            self._supervisor.report_progress,
            catalogue=self.drives.catalogue,
            ports=inventory.external_ports,
            identities=identities,
            capabilities=capabilities,
            sessions=sessions,
            node_network=lambda: self.node_network.up,
            attempts=self._attempts,
        )
        self._supervisor.starter = self._starter
        self._housekeeping = Housekeeping(
            client, inventory.name, runtime, self._starter, self._attempts, self._settings, self.node_network,
            identities,
        )  # fmt: skip

    # ---- the lease ---------------------------------------------------------------------------------------------

    @property
    def lost(self) -> asyncio.Event:
        """Set once its lease is lost: the agent then stops its workers (or registers again) and exits."""
        return self._lease.lost

    @property
    def lost_why(self) -> str:
        return self._lease.lost_why

    @lost_why.setter
    def lost_why(self, why: str) -> None:
        self._lease.lost_why = why

    @property
    def registrations(self) -> int:
        return self._lease.registrations

    @property
    def registered_at(self) -> datetime | None:
        return self._lease.registered_at

    def registered(self, view: NodeView) -> None:
        """The machine's workflow took this agent's registration (its first, or again after its lease expired): it
        holds the lease again, and looks at once for attempts its runs no longer have."""
        self.node_network.forget()  # asked again: a machine removed meanwhile had its subnet freed
        self.drives.chosen(view.data_location)
        if self._lease.registrations:
            # Its lease had expired: an exit returned lately may never have reached its run (the activity had
            # timed out, or its run had given up on it when the machine was lost): tell the run again.
            self._attempts.registered_again(time.monotonic(), RETURNED_KEPT_SECONDS)
        self._lease.took(view)
        self._housekeeping.look_soon()

    def inventory(self) -> NodeInventory:
        """What the machine has, with its GPUs' health and its pressure as last seen: what it registers again."""
        return self._lease.inventory()

    def lease_idle_seconds(self) -> float:
        """How long no lease was held here: long past its TTL, the machine's workflow holds none for this agent."""
        return self._lease.idle_seconds()

    async def keep_fence(self) -> None:
        """Runs as long as the agent: at its fence (no renewal recorded by Temporal for `fence_seconds`) it stops
        every worker of the machine (`Lease.keep_fence`)."""
        await self._lease.keep_fence(self._housekeeping.stop_everything)

    @property
    def fenced(self) -> bool:
        return self._lease.fenced

    @implements(contracts.hold_lease)
    async def hold_lease(self, input: LeaseInput) -> None:
        """Renew the machine's lease by heartbeating until the control plane cancels it; meanwhile report the
        GPUs' health and the machine's pressure to the machine's workflow when they change."""
        await self._lease.hold(input)

    # ---- attempts ----------------------------------------------------------------------------------------------

    @implements(contracts.start_task)
    async def start_task(self, input: StartTaskInput) -> StartTaskResult:
        """Admit the attempt within the machine's real free GPUs, prepare it (reporting each wait to the run,
        and waiting as long as a step waits), pull its image, and start it. A retry finds what it started.
        With `barrier` it stops short of the start, its GPUs held for it until the run starts or stops it."""
        gpus, started, picked_up, held = await self._supervisor.start(input)
        return StartTaskResult(gpu_indices=gpus, started=started, picked_up_at=picked_up, node_address=held)

    @implements(contracts.run_task)
    async def run_task(self, input: RunTaskInput) -> TaskExit:
        """A worker's whole life here in one activity: start it (as start_task), tell the run it was started and
        runs, then watch it until it ends (as supervise_task). Called again, it finds what it started."""
        _, _, picked_up, _ = await self._supervisor.start(input.start, input.settings)
        ref = input.start.ref
        started_at = datetime.now(UTC)
        external = await self._supervisor.external(ref) if input.start.group.external_access else {}
        address = await self.node_network.address_of(ref) if input.start.group.on_mesh else None
        report = TaskRunning(
            **ref.ids(), started=True, picked_up_at=picked_up, started_at=started_at, external=external,
            node_address=address,
        )  # fmt: skip
        return await self._supervisor.watch(ref, input.settings, input.readiness, report)

    @implements(contracts.supervise_task)
    async def supervise_task(self, input: SuperviseInput) -> TaskExit:
        """Report the worker running, then watch it until it ends, heartbeating all along; with a readiness
        check, report its health to the run whenever it changes. A supervisor that re-attached after a missed
        heartbeat says it is heard again."""
        report = TaskRunning(**input.ref.ids(), heartbeat=input.reattach)
        _beat_later(input.settings)
        return await self._supervisor.watch(input.ref, input.settings, input.readiness, report)

    @implements(contracts.stop_task)
    async def stop_task(self, input: StopTaskInput) -> None:
        """The stop signal, the grace period, then a kill; returns once the worker has ended. A worker still
        being set up stops there."""
        await _heartbeating(self._starter.stop(input.ref, input.grace_seconds))

    @contextlib.contextmanager
    def _live_attempt(self, ref: TaskRef) -> Iterator[None]:
        """While an activity starts or watches the attempt, its run has it: the look for stale attempts skips it."""
        with self._supervisor.live(ref):
            yield

    # ---- housekeeping ------------------------------------------------------------------------------------------

    async def adopt_attempts(self) -> int:
        """At the start of an agent process: adopt the attempts an earlier process left (`Housekeeping.adopt`)."""
        return await self._housekeeping.adopt()

    async def stop_own_tasks(self, grace_seconds: float) -> int:
        """Stop every attempt this agent started or watched that still runs; returns how many it stopped."""
        return await self._housekeeping.stop_own_tasks(grace_seconds)

    async def remove_deleted_runs(self) -> int:
        """Remove the attempts of runs deleted while this machine was away; returns how many."""
        return await self._housekeeping.remove_deleted_runs()

    @implements(contracts.delete_run_files)
    async def delete_run_files(self, input: DeleteRunFilesInput) -> DeletedFiles:
        """Remove every attempt of a deleted run here (stopping any that still runs): directory or container, log
        and files. Called again, it finds nothing left."""
        return await self._housekeeping.delete_run(input)

    # ---- logs and sessions -------------------------------------------------------------------------------------

    @implements(contracts.read_log)
    async def read_log(self, input: ReadLogInput) -> LogText:
        """An attempt's output (stdout and stderr), the last `max_bytes` of it, for `astraeus logs`."""
        text = await asyncio.to_thread(self._runtime.log_tail, input.ref, input.lines, input.max_bytes)
        return LogText(text=text)

    @implements(contracts.grant_session)
    async def grant_session(self, input: GrantSessionInput) -> SessionGranted:
        """Let the holder of a token run commands in a running attempt here, until it expires (its public key)."""
        sessions = self._hosting_sessions()
        try:
            expires = await asyncio.to_thread(
                sessions.grant, input.ref, input.public_key, input.ttl_seconds, datetime.now(UTC)
            )
        except SessionRefused as err:
            raise ApplicationError(str(err), type="SessionRefused", non_retryable=True) from None
        return SessionGranted(expires_at=expires)

    @implements(contracts.attach_session)
    async def attach_session(self, input: AttachInput) -> Attached:
        """Run a person's command in a running attempt here, for a request signed by a token granted for it."""
        sessions = self._hosting_sessions()
        try:
            return await asyncio.to_thread(sessions.attach, input.ref, input, datetime.now(UTC))
        except SessionRefused as err:
            raise ApplicationError(str(err), type="SessionRefused", non_retryable=True) from None

    def _hosting_sessions(self) -> Sessions:
        if self._sessions is None or not self._sessions.hosts:
            why = f"machine {self.node_name} hosts no interactive sessions (its agent runs --no-interactive-sessions)"
            raise ApplicationError(why, type="SessionRefused", non_retryable=True)
        return self._sessions
