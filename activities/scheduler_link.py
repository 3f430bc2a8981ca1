"""The scheduler's door for runs: `place` and `release` over HTTP on the scheduler's own address.

A run calls these two as local activities of the control plane (protocol 3): each costs the run's history one
marker and no workflow task of its own, against three events and a workflow task for an activity on the
scheduler's task queue (bench/README.md measures what that is worth in a burst). The door serves the same
`SchedulerService.place` / `release` as those activities, so the decisions do not depend on the way in; the
scheduler keeps its task queue for the machines' and quotas' changes, and for runs created before protocol 3.

The door listens on loopback by default. Across hosts, give it an address on the control plane's private network,
and the same token to both sides (`ASTRAEUS_SCHEDULER_TOKEN`): calls without it are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import uvicorn
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio import activity

from activities.scheduler import SchedulerService
from workflows.messages import PlaceInput, PlaceResult, ReleaseInput

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:7244"  # `astraeus scheduler --listen` and `astraeus control --scheduler`
TOKEN_VARIABLE = "ASTRAEUS_SCHEDULER_TOKEN"
CALL_TIMEOUT_SECONDS = 20.0
CALLS_AT_ONCE = 16  # calls of one control process in flight to the scheduler; the others wait their turn  # below the local activities' 30 s StartToClose: a call that hangs is tried again


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (the port may be 0 to listen on any free one); raises ValueError naming what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"scheduler address {address!r}: expected HOST:PORT, e.g. {DEFAULT_ADDRESS}")
    return host, int(port)


def scheduler_app(service: SchedulerService, token: str | None) -> Starlette:
    """POST /place and /release with the activities' inputs as JSON; the results as JSON."""

    async def call(request: Request, model: type[BaseModel], handle: Any) -> Response:
        if token and not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
            return JSONResponse({"error": "the scheduler's token is missing or wrong"}, status_code=401)
        try:
            message = model.model_validate_json(await request.body())
        except ValidationError as error:
            return JSONResponse({"error": f"{model.__name__}: {error}"}, status_code=400)
        result = await handle(message)
        return Response(result.model_dump_json() if result is not None else "null", media_type="application/json")

    async def place(request: Request) -> Response:
        return await call(request, PlaceInput, service.place)

    async def release(request: Request) -> Response:
        return await call(request, ReleaseInput, service.release)

    return Starlette(routes=[Route("/place", place, methods=["POST"]), Route("/release", release, methods=["POST"])])


class SchedulerDoor:
    """The door's socket, bound (and listening) as soon as it is made, so that the control plane can be told its
    address before the scheduler has rebuilt its view; calls that arrive meanwhile wait in the socket's queue and
    are answered once the door opens."""

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None) -> None:
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host.strip("[]"), port))
        except OSError as error:
            self._socket.close()
            raise OSError(f"the scheduler cannot listen on {address}: {error.strerror}") from None
        self._socket.listen(1024)
        self._socket.setblocking(False)
        bound = self._socket.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
        self._token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Future[None] | None = None

    async def open(self, service: SchedulerService) -> None:
        """Serve calls (those waiting first), until closed."""
        config = uvicorn.Config(
            scheduler_app(service, self._token),
            lifespan="off",
            log_level="warning",
            access_log=False,
            date_header=False,
            server_header=False,
            timeout_graceful_shutdown=1,
        )
        self._server = _Server(config)
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))

    async def close(self) -> None:
        if self._server is not None and self._serving is not None:
            self._server.should_exit = True
            await self._serving
            self._server = self._serving = None
        self._socket.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process keeps its own signal handlers: the scheduler closes its door when it ends


class SchedulerLink:
    """The control plane's end: the local activities `place` and `release`, calling the scheduler's door."""

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None) -> None:
        parse_address(address)
        token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
        self.address = address
        self._http = httpx.AsyncClient(
            base_url=f"http://{address}",
            headers={"authorization": f"Bearer {token}"} if token else {},
            timeout=httpx.Timeout(CALL_TIMEOUT_SECONDS, connect=5.0),
            limits=httpx.Limits(max_connections=CALLS_AT_ONCE, max_keepalive_connections=CALLS_AT_ONCE),
        )
        # httpx's pool assigns its queued requests to connections anew at every change, in time proportional to
        # both: a burst's hundreds of calls queued there cost 14 ms of CPU each. They queue here instead.
        self._gate = asyncio.Semaphore(CALLS_AT_ONCE)

    @activity.defn(name="place")
    async def place(self, input: PlaceInput) -> PlaceResult:
        return PlaceResult.model_validate_json(await self._call("/place", input))

    @activity.defn(name="release")
    async def release(self, input: ReleaseInput) -> None:
        await self._call("/release", input)

    async def _call(self, path: str, message: BaseModel) -> bytes:
        """The answer's body. Every failure is tried again by the local activity's retry policy, a refusal too (a
        wrong token, a message this scheduler cannot read): the run waits, and goes on once the scheduler is
        mended, rather than fail for a fault of the cluster's set-up. The control plane's log says why."""
        try:
            async with self._gate:
                response = await self._http.post(
                    path, content=message.model_dump_json(), headers={"content-type": "application/json"}
                )
        except httpx.HTTPError as error:
            raise RuntimeError(f"the scheduler at {self.address} did not answer {path}: {error!r}") from None
        if response.status_code != 200:
            raise RuntimeError(
                f"the scheduler at {self.address} answered {path} with {response.status_code}: {response.text}"
            )
        return response.content

    async def close(self) -> None:
        await self._http.aclose()
