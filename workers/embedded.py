"""The embedded default: the Temporal dev server, the control plane, the scheduler and N local machines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType

from temporalio.client import Client

from activities.scheduler_link import SchedulerDoor
from workers.agent_process import AgentOptions, Part, start_agent
from workers.connect import connect
from workers.devserver import DevServer
from workers.services import ControlWorker, scheduler_worker
from workers.telemetry import Telemetry
from workflows.domain.settings import Settings

log = logging.getLogger(__name__)


class Embedded:
    """`astraeus dev` in one process: `async with Embedded(...) as e:` then submit to `e.client`."""

    def __init__(
        self,
        data_dir: Path,
        port: int = 7233,
        ui_port: int | None = 8233,
        nodes: int = 1,
        gpus: str | None = None,
        cpus: float | None = None,
        memory_bytes: int | None = None,
        settings: Settings | None = None,
        runtime: str = "process",
        docker_host: str | None = None,
        telemetry: Telemetry | None = None,
    ) -> None:
        data_dir = data_dir.resolve()  # handed to the server and to every worker's shim, which start elsewhere
        self.server = DevServer(data_dir, port=port, ui_port=ui_port)
        self.data_dir = data_dir
        self.node_count = nodes
        self.machine = {
            "gpus": gpus,
            "cpus": cpus,
            "memory_bytes": memory_bytes,
            "runtime": runtime,
            "docker_host": docker_host,
        }
        self.settings = settings or Settings()
        self.telemetry = telemetry or Telemetry()  # traces and metrics of every part: they share one client
        self.workers: list[Part] = []
        self._running: list[asyncio.Task[None]] = []
        self.client: Client | None = None
        self.scheduler_address: str | None = None  # the scheduler's door, once started
        self.control_build: str | None = None  # the build of its control plane's worker, once started (AstraeusClient)

    async def __aenter__(self) -> Embedded:
        await asyncio.to_thread(self.server.start)
        try:
            self.client = await connect(
                self.server.address,
                wait=timedelta(seconds=30),
                runtime=self.telemetry.runtime,
                interceptors=self.telemetry.interceptors,
            )
            door = SchedulerDoor("127.0.0.1:0")  # any free port: the control plane is told which
            self.scheduler_address = door.address
            control = ControlWorker(self.client, self.settings, door, ca_dir=self.data_dir / "ca")  # the door: no HTTP
            self.control_build = control.build_id
            self._run(control)
            self._run(await scheduler_worker(self.client, door, self.settings))
            for i in range(self.node_count):
                options = AgentOptions(
                    name=f"local-{i}",
                    data_dir=self.data_dir / "nodes" / f"local-{i}",
                    **self.machine,  # type: ignore[arg-type]
                )
                self._run(await start_agent(self.client, options, self.settings))
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    def _run(self, worker: Part) -> None:
        self.workers.append(worker)
        running = asyncio.ensure_future(worker.run())
        running.add_done_callback(_log_end)
        self._running.append(running)

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await shut_down(self.workers, self._running)
        await asyncio.to_thread(self.server.stop)


async def shut_down(workers: Sequence[Part], running: Sequence[asyncio.Future[None]]) -> None:
    """Shut the parts down, the last started first, then wait for each to end; what they raise was logged."""
    for worker in reversed(workers):
        with contextlib.suppress(Exception):
            await worker.shutdown()
    for task in running:
        with contextlib.suppress(BaseException):
            await task


def _log_end(running: asyncio.Task[None]) -> None:
    """A part that ends before the whole (an agent that lost its lease, say) says why in the log."""
    if not running.cancelled() and running.exception() is not None:
        log.error("%s", running.exception())
