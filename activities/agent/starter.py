"""Starting a worker on this machine: admit it within the real free GPUs, prepare it, pull its image, then start it.

What `start_task` and `stop_task` share. A step that waits (a secret not synced yet, a drive not there yet) is
reported to the run and tried again until it is ready; a pull is reported before it begins. A gang member is first
set up without starting (`ready`, at the barrier): its GPUs stay reserved for it until the run starts it or stops
it. A stop that arrives while the attempt is still being set up ends the setup, and waits for a start already
handed to the runtime, so a stopped attempt never keeps running.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from activities.agent.capabilities import CapabilitySetup, Services, SetUp
from activities.agent.identities import Identities
from activities.agent.node_network import NodeNetworkUp, network_missing
from activities.agent.prepare import Prepared, Preparer, Waiting
from activities.agent.runtime.base import Launch, Mount, NetworkNotUp, OnProgress, Runtime, RuntimeFailure
from activities.agent.runtime.shim import write_atomically
from activities.agent.sessions import Sessions
from workflows.domain.constraints import Drive
from workflows.domain.inventory import GpuInfo, PortRange
from workflows.domain.machine.attempts import Attempts, PortMapping, Refused, admit_gpus, assign_ports
from workflows.domain.reasons import R, Reason
from workflows.domain.refs import TaskRef
from workflows.domain.requests import placed_drives
from workflows.domain.spec import GroupSpec

NODE_ADDRESS_FILE = "node-address"  # with an attempt's files: the address held for it on the node network

log = logging.getLogger(__name__)

# Tells the run what its worker waits for, or that its image is being pulled (signal `task_progress`).
Report = Callable[[TaskRef, Reason], Coroutine[Any, Any, None]]
# Heartbeats the activity with what it does now, so a retry knows what was already reported.
Beat = Callable[[str], None]
# The cluster's catalogue of drives (the drives workflow's query), read when a worker mounts some.
Catalogue = Callable[[], Awaitable[Mapping[str, Drive]]]
# The machine's node network once it is up (subnet assigned, network made), else None.
NodeNetworkState = Callable[[], NodeNetworkUp | None]
# Called just before the runtime starts an attempt; raises to refuse the start (its attempt is stale: fencing).
Fence = Callable[[], Awaitable[None]]

PREPARE_RETRY_SECONDS = 1.0
REPORT_TIMEOUT_SECONDS = 30.0
# Starts and pulls run on threads of their own: a start mostly waits (fork, exec, the shim's or the engine's own
# start), and on the default pool (6 threads on 2 cores, shared with every observe and log read, and by every
# machine of a process hosting several) a burst's starts waited for each other's.
START_THREADS = 16


def bindable(port: int) -> bool:
    """Whether nothing on the machine holds the port now (another program, or a worker this agent does not know)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def node_hostname(key: TaskRef) -> str:
    """A worker's name on its machine's node network: `<worker>.<run>.<workspace>`, the same for every attempt."""
    return f"{key.task_id}.{key.job}.{key.namespace}"


class SetupEnded(Exception):
    """The attempt cannot be set up; `reason` says why (a RuntimeFailure's, or a stop)."""

    def __init__(self, reason: Reason) -> None:
        super().__init__(reason.text)
        self.reason = reason


class Starter:
    def __init__(
        self,
        runtime: Runtime,
        preparer: Preparer,
        gpus: Callable[[], list[GpuInfo]],
        report: Report,
        retry_seconds: float = PREPARE_RETRY_SECONDS,
        catalogue: Catalogue | None = None,
        ports: PortRange | None = None,
        identities: Identities | None = None,
        capabilities: CapabilitySetup | None = None,
        sessions: Sessions | None = None,
        node_network: NodeNetworkState | None = None,
        attempts: Attempts | None = None,
    ) -> None:
        self._runtime = runtime
        self.attempts = attempts or Attempts()  # every attempt this machine holds: shared with its agent
        self._sessions = sessions  # where attempts' interactive sessions are granted; None: it hosts none
        self._node_network = node_network or (lambda: None)
        self._catalogue = catalogue
        self._capabilities = capabilities or CapabilitySetup(Services(), (), {})
        self._threads = ThreadPoolExecutor(max_workers=START_THREADS, thread_name_prefix="start")
        self._retry_seconds = retry_seconds
        self._preparer = preparer
        self._gpus = gpus
        self._report = report
        self._admission = asyncio.Lock()  # GPUs are chosen and taken in one step
        # The runtime's starts under way, to be awaited (by a stop, a repeated start); the attempt's phase says so.
        self._starts: dict[TaskRef, asyncio.Future[None]] = {}
        self._port_range = ports  # the machine's ports for external access (--external-ports); None: none
        self._identities = identities  # where attempts' certificates are asked for and kept

    async def start(
        self,
        key: TaskRef,
        group: GroupSpec,
        env: dict[str, str],
        beat: Beat,
        reported: str | None = None,
        host_network: bool = False,
        fence: Fence | None = None,
    ) -> list[int]:
        """Start the attempt; returns its GPUs. `reported` is the reason a former try already reported;
        `host_network`: it shares the machine's network (a gang member); `fence` is awaited just before the
        runtime starts it, and refuses the start by raising (its GPUs are given back).
        Raises SetupEnded when it cannot be set up, RuntimeUnavailable when the runtime does not answer."""
        gpus, launch = await self._set_up(key, group, env, beat, reported, host_network)
        if launch is None:
            return gpus
        if fence is not None and not self.attempts.starting(key):
            try:
                await fence()
                self._not_stopped(key)  # a stop may have come while the run was asked
            except BaseException:
                self.attempts.let_go(key)
                raise
        await self._run_start(key, launch, beat)
        return gpus

    async def ready(
        self, key: TaskRef, group: GroupSpec, env: dict[str, str], beat: Beat, reported: str | None = None
    ) -> tuple[list[int], bool, str | None]:
        """Set the attempt up to the gang barrier without starting it: admit, prepare, pull. Its GPUs stay
        reserved until a later `start` starts it or a `stop` ends it. Returns its GPUs, whether it already
        started (a barrier call repeated after the start), and on the node network the address held for it there,
        which the gang's others reach it at once it starts (MASTER_ADDR)."""
        gpus, launch = await self._set_up(key, group, env, beat, reported)
        if launch is None:
            return gpus, True, None
        held = await asyncio.to_thread(self._hold_node_address, key) if launch.network is not None else None
        return gpus, False, held

    async def stop(self, key: TaskRef, grace_seconds: float) -> None:
        """Stop the attempt: end its setup, let a start already in the runtime finish, then stop what runs. One
        set up at the barrier and never started gives its GPUs back."""
        self.attempts.stop_asked(key)
        starting = self._starts.get(key)
        if starting is not None:
            await asyncio.wait([starting])
        else:
            self.attempts.let_go(key)  # a setup still in flight ends at its next step
        await asyncio.to_thread(self._runtime.stop, key, grace_seconds)

    async def delete(self, key: TaskRef, grace_seconds: float) -> None:
        """Stop the attempt if it runs, then remove it from the machine: its directory or container, its log, and
        the files it was given (its run was deleted)."""
        if (await asyncio.to_thread(self._runtime.observe, key)).running:
            await self.stop(key, grace_seconds)
        await asyncio.to_thread(self._runtime.delete, key)
        await asyncio.to_thread(shutil.rmtree, self._preparer.config_root / key.slug, True)
        if self._identities is not None:
            await asyncio.to_thread(shutil.rmtree, self._identities.directory(key), True)
        if self._sessions is not None:
            await asyncio.to_thread(shutil.rmtree, self._sessions.directory(key), True)

    # ---- steps ------------------------------------------------------------------------------------------------

    async def _set_up(
        self,
        key: TaskRef,
        group: GroupSpec,
        env: dict[str, str],
        beat: Beat,
        reported: str | None,
        host_network: bool = False,
    ) -> tuple[list[int], Launch | None]:
        """Admit, prepare and pull; the launch to hand to the runtime, or None when it already started. On any
        failure its GPUs are given back, unless a former try's start still holds them."""
        self._not_stopped(key)
        gpus, started = await self._admit(key, group.gpus)
        if started:
            return gpus, None
        try:
            launch = await self._prepare(key, group, env, gpus, beat, reported)
            # A worker on the node network has its own address there, not the machine's network: the one held for
            # it at the barrier, if it was.
            held = await asyncio.to_thread(self._held_node_address, key) if launch.network is not None else None
            launch = dataclasses.replace(launch, host_network=host_network and launch.network is None, network_ip=held)
            attempt = self.attempts.get(key)
            if attempt is None or not attempt.pulled:
                self._not_stopped(key)
                if self._runtime.pulls_images:
                    pulling = asyncio.ensure_future(
                        self._call(key, lambda progress: self._runtime.ensure_image(launch, progress), reported)
                    )
                    await self._beat_until_done(key, pulling, beat)
                else:  # it only checks the launch: no thread
                    try:
                        self._runtime.ensure_image(launch)
                    except RuntimeFailure as failure:
                        raise SetupEnded(failure.reason) from None
                self.attempts.pulled(key)
            self._not_stopped(key)  # nothing is awaited from here to the start
        except BaseException:
            self.attempts.let_go(key)
            raise
        # The image is ready: Always was honoured by that pull, and the start need not pull it again.
        if launch.pull_policy == "Always":
            launch = dataclasses.replace(launch, pull_policy="IfNotPresent")
        return gpus, launch

    def _not_stopped(self, key: TaskRef) -> None:
        if self.attempts.stopping(key):
            raise SetupEnded(R.StoppedOnRequest())

    async def _admit(self, key: TaskRef, count: int) -> tuple[list[int], bool]:
        """Its GPUs, and whether it already started. New attempts get free, unfaulted GPUs, healthy ones first."""
        async with self._admission:
            # What is held is read before the runtime is asked what runs, and again after: a start that ends during
            # the look is in one of them (`admit_gpus`).
            before = self.attempts.gpus_held()
            in_use = await asyncio.to_thread(self._runtime.gpus_in_use)
            after = self.attempts.gpus_held()
            admission = admit_gpus(key, count, self._gpus(), in_use, before, after)
            if isinstance(admission, Refused):
                raise SetupEnded(R.ContainerStartFailed(error=admission.error))
            if admission.started or key.slug in after:
                return admission.gpus, admission.started
            keep = [*in_use, *before, *after, key.slug]
            self._preparer.forget(keep=keep)
            if self._identities is not None:
                self._identities.forget(keep=keep)
            if self._sessions is not None:
                self._sessions.forget(keep=keep)
            self.attempts.admitted(key, admission.gpus)
            return admission.gpus, False

    async def _prepare(
        self, key: TaskRef, group: GroupSpec, env: dict[str, str], gpus: list[int], beat: Beat, reported: str | None
    ) -> Launch:
        """Prepare until every step is ready, reporting each new wait to the run once."""
        while True:
            self._not_stopped(key)
            ports = await self._assign_ports(key, group)
            catalogue = await self._catalogue() if self._catalogue is not None and placed_drives(group) else None
            try:
                if ports is None:
                    outcome: Prepared | Waiting = Waiting(R.WaitingForExternalPort())
                elif not self._preparer.touches_files(group):  # nothing to read or write: no thread
                    outcome = self._preparer.prepare(key, group, catalogue)
                else:
                    outcome = await asyncio.to_thread(self._preparer.prepare, key, group, catalogue)
            except RuntimeFailure as failure:
                raise SetupEnded(failure.reason) from None
            network = self._joined_network(group)
            if not isinstance(outcome, Waiting) and group.on_mesh and not network:
                outcome = Waiting(R.WaitingForNodeNetwork())
            if not isinstance(outcome, Waiting) and group.identity:  # the last step: its certificate
                waits = await self._identity(key)
                outcome = Waiting(waits) if waits is not None else outcome
            if not isinstance(outcome, Waiting):
                break
            if outcome.reason.text != reported:
                await self._report(key, outcome.reason)
                reported = outcome.reason.text
            beat(reported)
            await asyncio.sleep(self._retry_seconds)
        try:  # what the worker requires of its machine, once its drives and secrets are there
            setup = (
                SetUp()
                if group.capabilities is None
                else await asyncio.to_thread(self._capabilities.set_up, group.capabilities)
            )
            if group.capabilities is not None and group.capabilities.interactive_token:
                await asyncio.to_thread(self._set_up_sessions, key)
        except RuntimeFailure as failure:
            raise SetupEnded(failure.reason) from None
        identity_env: dict[str, str] = {}
        identity_mounts: list[Mount] = []
        if group.identity and self._identities is not None:
            identity_env, identity_mounts = self._identities.files(key, in_container=self._runtime.name != "process")
        alias, network_env = None, {}
        if network is not None:  # its name on the node network, where the run's other workers reach it
            alias = node_hostname(key)
            network_env = {"ASTRAEUS_NODE_SUBNET": network.subnet, "ASTRAEUS_NODE_HOSTNAME": alias}
        return Launch(
            command=group.command,
            env={**env, **outcome.env, **setup.env, **identity_env, **network_env},
            network=network.name if network is not None else None,
            network_alias=alias,
            sandbox_runtime=setup.sandbox_runtime,
            egress=setup.egress,
            image=group.image,
            gpu_indices=gpus,
            cpu=group.cpu,
            memory_bytes=group.worker_memory_bytes,
            pull_policy=group.pull_policy,
            registry_auth=outcome.registry_auth,
            mounts=[*outcome.mounts, *identity_mounts],
            ports=ports or [],
        )

    def _set_up_sessions(self, key: TaskRef) -> None:
        if self._sessions is None:
            raise RuntimeFailure(R.InteractiveTokenFailed(why="this machine's agent hosts no interactive sessions"))
        self._sessions.set_up(key)

    def _hold_node_address(self, key: TaskRef) -> str:
        """The attempt's address on the node network, held for it (kept with its files, so that a restarted agent
        holds the same one): asked of the runtime once, clear of the addresses held for the others."""
        held = self._held_node_address(key)
        if held is not None:
            return held
        others = {path.read_text() for path in self._preparer.config_root.glob(f"*/{NODE_ADDRESS_FILE}")}
        hold = getattr(self._runtime, "hold_node_address")  # noqa: B009 (the docker runtime's: it hosts the network)
        try:
            address: str = hold(others)
        except NetworkNotUp as err:
            why = f"network.mesh: no address on the node network: {err}"
            raise SetupEnded(R.ContainerStartFailed(error=why)) from None
        directory = self._preparer.config_root / key.slug
        directory.mkdir(parents=True, exist_ok=True)
        write_atomically(directory / NODE_ADDRESS_FILE, address)
        return address

    def _held_node_address(self, key: TaskRef) -> str | None:
        try:
            return (self._preparer.config_root / key.slug / NODE_ADDRESS_FILE).read_text()
        except FileNotFoundError:
            return None

    def _joined_network(self, group: GroupSpec) -> NodeNetworkUp | None:
        """The node network a mesh worker joins, None while it is not up (or the worker asks for none); a machine
        that cannot host it fails the worker (its scheduler keeps such workers off it)."""
        if not group.on_mesh:
            return None
        missing = network_missing(self._runtime)
        if missing is not None:
            raise SetupEnded(R.ContainerStartFailed(error=f"network.mesh: {missing}"))
        return self._node_network()

    async def _identity(self, key: TaskRef) -> Reason | None:
        """Why the attempt still waits for its certificate, or None once it holds one."""
        if self._identities is None:
            raise SetupEnded(R.ContainerStartFailed(error="identity: this machine's agent issues no identities"))
        return await self._identities.ensure(key)

    async def _assign_ports(self, key: TaskRef, group: GroupSpec) -> list[PortMapping] | None:
        """The machine's ports for the attempt's external access, each from the range, held by no attempt that
        runs or is being set up, and free on the machine now; None while not enough are (it waits)."""
        if not group.external_access:
            return []
        async with self._admission:  # chosen and taken in one step, as GPUs are
            attempt = self.attempts.get(key)
            if attempt is not None and attempt.holding and attempt.ports is not None:
                return list(attempt.ports)
            before = self.attempts.ports_held()
            running = await asyncio.to_thread(self._runtime.ports_in_use) if self._port_range is not None else {}
            after = self.attempts.ports_held()
            assigned = assign_ports(group.external_access, self._port_range, running, before, after, bindable)
            if isinstance(assigned, Refused):
                raise SetupEnded(R.ContainerStartFailed(error=assigned.error))
            if assigned is not None:
                self.attempts.ports_assigned(key, assigned)
            return assigned

    async def _run_start(self, key: TaskRef, launch: Launch, beat: Beat) -> None:
        """Hand the start to the runtime. It is not interrupted: if this activity is cancelled, the start still
        finishes (and a stop waits for it); its GPUs stay reserved until the runtime holds them."""
        starting = self._starts.get(key)
        if starting is None:
            self.attempts.handed_to_runtime(key)
            starting = asyncio.ensure_future(
                self._call(key, lambda progress: self._runtime.start(key, launch, progress))
            )
            self._starts[key] = starting

            def done(ended: asyncio.Future[None]) -> None:
                self._starts.pop(key, None)
                self.attempts.start_ended(key, started=not ended.cancelled() and ended.exception() is None)

            starting.add_done_callback(done)
        await self._beat_until_done(key, starting, beat)
        if self.attempts.stopping(key):  # stopped while it started: the stop that waited for it ends it
            raise SetupEnded(R.StoppedOnRequest())

    async def _call(self, key: TaskRef, work: Callable[[OnProgress], None], reported: str | None = None) -> None:
        """`work` on a thread; what it says it does (R.Pulling) is reported to the run unless already reported."""
        loop = asyncio.get_running_loop()
        self.attempts.doing(key, reported or "starting")

        def on_progress(reason: Reason) -> None:  # called on the runtime's thread
            loop.call_soon_threadsafe(self.attempts.doing, key, reason.text)
            if reason.text == reported:  # a former try reported it
                return
            try:
                asyncio.run_coroutine_threadsafe(self._report(key, reason), loop).result(REPORT_TIMEOUT_SECONDS)
            except Exception as err:  # the run learns it later from the outcome; never fail a pull for it
                log.warning("%s: could not report %r: %s", key.slug, reason.text, err)

        try:
            await loop.run_in_executor(self._threads, work, on_progress)
        finally:
            self.attempts.doing(key, None)

    async def _beat_until_done(self, key: TaskRef, work: asyncio.Future[None], beat: Beat) -> None:
        """Heartbeat with what `work` does until it ends, never cancelling it (a cancelled activity leaves it to
        finish); its RuntimeFailure ends the setup with the runtime's reason."""
        while not work.done():
            attempt = self.attempts.get(key)
            beat(attempt.doing or "starting" if attempt is not None else "starting")
            await asyncio.wait([asyncio.shield(work)], timeout=1.0)
        try:
            work.result()
        except RuntimeFailure as failure:
            raise SetupEnded(failure.reason) from None
