"""The scheduler's door for runs: `place` and `release` over HTTP on the scheduler's own address; and `GET /usage`,
what its placements hold, for the HTTP API's console pages.

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
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import uvicorn
from pydantic import TypeAdapter, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from activities.scheduler import SchedulerService
from workflows import contracts
from workflows.contracts import implements
from workflows.domain.scheduling.use import ClusterUse
from workflows.messages import PlaceInput, PlaceResult, ReleaseInput

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:7244"  # `astraeus scheduler --listen` and `astraeus control --scheduler`
TOKEN_VARIABLE = "ASTRAEUS_SCHEDULER_TOKEN"
CALL_TIMEOUT_SECONDS = 20.0
REQUESTS_AT_ONCE = 4  # requests of one kind a control process has in flight; the calls made meanwhile wait
BATCH_MAX = 200  # calls in one request
JSON = "application/json"
JSON_HEADERS = {"content-type": JSON}
NOTHING = TypeAdapter(list[None])  # below the local activities' 30 s StartToClose: a call that hangs is tried again


def parse_address(address: str) -> tuple[str, int]:
    """`HOST:PORT` (the port may be 0 to listen on any free one); raises ValueError naming what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"scheduler address {address!r}: expected HOST:PORT, e.g. {DEFAULT_ADDRESS}")
    return host, int(port)


PLACES = TypeAdapter(list[PlaceInput])
PLACED = TypeAdapter(list[PlaceResult])
RELEASES = TypeAdapter(list[ReleaseInput])


EPOCH_HEADER = "x-astraeus-scheduler-epoch"  # on every answer of a scheduler that holds the lease: its term


def scheduler_app(door: SchedulerDoor, token: str | None) -> Starlette:
    """POST /place and /release: a JSON list of the activities' inputs (the calls of one control process that
    leave together), answered by the list of their results, in order. The calls of one request are decided
    together: they join the same scheduling pass. Each call is served by the door's service of the moment: while it
    has none (a standby, a scheduler that lost its lease or rebuilds its view) every call is refused with 503 and
    why, for its local activity to try again."""

    def refused(request: Request) -> Response | None:
        if token and not secrets.compare_digest(request.headers.get("authorization", ""), f"Bearer {token}"):
            return JSONResponse({"error": "the scheduler's token is missing or wrong"}, status_code=401)
        return None

    def serving(request: Request) -> SchedulerService | Response:
        if (refusal := refused(request)) is not None:
            return refusal
        service = door.service
        if service is None:
            return JSONResponse({"error": door.refusal}, status_code=503, headers={"retry-after": "1"})
        return service

    def answer(service: SchedulerService, body: bytes) -> Response:
        return Response(body, media_type=JSON, headers={EPOCH_HEADER: str(service.epoch)})

    async def call(request: Request, inputs: TypeAdapter[list[Any]], handle: Callable[..., Awaitable[Any]]) -> Any:
        service = serving(request)
        if isinstance(service, Response):
            return service
        try:
            messages = inputs.validate_json(await request.body())
        except ValidationError as error:
            return JSONResponse({"error": str(error)}, status_code=400)
        return service, await asyncio.gather(*(handle(service, message) for message in messages))

    async def place(request: Request) -> Response:
        answer_ = await call(request, PLACES, SchedulerService.place)
        if isinstance(answer_, Response):
            return answer_
        service, results = answer_
        return answer(service, PLACED.dump_json(results))

    async def release(request: Request) -> Response:
        answer_ = await call(request, RELEASES, SchedulerService.release)
        if isinstance(answer_, Response):
            return answer_
        service, results = answer_
        return answer(service, NOTHING.dump_json([None] * len(results)))

    async def usage(request: Request) -> Response:
        service = serving(request)
        return service if isinstance(service, Response) else answer(service, service.usage().model_dump_json().encode())

    routes = [Route("/place", place, methods=["POST"]), Route("/release", release, methods=["POST"])]
    return Starlette(routes=[*routes, Route("/usage", usage, methods=["GET"])])


class SchedulerDoor:
    """The door's socket, bound as soon as it is made, so that the control plane can be told its address (and a
    second scheduler on it is refused) before the scheduler has rebuilt its view. Until it listens a call is refused
    by the socket; once it listens, a call is served by `service` while the scheduler holds its lease with a view
    rebuilt, and refused at once otherwise (503, saying why: a standby, a lease lost, a view being rebuilt), to be
    tried again by its local activity. A call must not wait for the rebuild, which asks every open run what it holds:
    a run whose workflow task waits on this door cannot answer until that task ends (the chaos suite measured 73 s
    for that wait against 4.5 s)."""

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
        self._socket.setblocking(False)
        bound = self._socket.getsockname()
        self.address = f"[{bound[0]}]:{bound[1]}" if family == socket.AF_INET6 else f"{bound[0]}:{bound[1]}"
        self._token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
        self._server: uvicorn.Server | None = None
        self._serving: asyncio.Future[None] | None = None
        self.service: SchedulerService | None = None  # while it serves: what a control plane in this process calls
        self.refusal = "its door is not open yet"  # why it serves no call, while it does not

    def serve(self, service: SchedulerService) -> None:
        """Serve calls with `service` from now on (its scheduler holds the lease, its view rebuilt)."""
        self.service = service

    def refuse(self, why: str) -> None:
        """Refuse every call from now on, saying why (a standby, a lease lost, a view being rebuilt)."""
        self.service, self.refusal = None, why

    async def open(self, service: SchedulerService) -> None:
        """Listen, and serve calls with `service` (those waiting first), until closed."""
        await self.listen()
        self.serve(service)

    async def listen(self) -> None:
        """Answer calls, until closed: served while it has a service, refused (503) while it has none."""
        if self._serving is not None:
            return
        config = uvicorn.Config(
            scheduler_app(self, self._token),
            lifespan="off",
            log_level="warning",
            access_log=False,
            date_header=False,
            server_header=False,
            timeout_graceful_shutdown=1,
        )
        try:
            self._socket.listen(1024)
        except OSError as error:  # another scheduler listens there already (it bound the port while rebuilding)
            raise OSError(f"the scheduler cannot listen on {self.address}: {error.strerror}") from None
        self._server = _Server(config)
        self._serving = asyncio.ensure_future(self._server.serve(sockets=[self._socket]))

    async def close(self) -> None:
        self.service = None
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
    """The control plane's end: the local activities `place` and `release`, calling the scheduler's door. Calls
    made while earlier ones are in flight leave together, in one request (a burst's hundreds of runs cost a few
    requests, not hundreds: each costs both ends a millisecond or more of CPU).

    Given the door itself (`SchedulerDoor`: the scheduler runs in this process, as in `astraeus dev`), the link calls
    its service directly, as the door would, with no HTTP between them: in a burst the HTTP of both ends was an
    eighth of the process's CPU. It is refused, as the door's socket refuses, until the door is open."""

    def __init__(self, address: str | SchedulerDoor = DEFAULT_ADDRESS, token: str | None = None) -> None:
        self._door = address if isinstance(address, SchedulerDoor) else None
        address = address.address if isinstance(address, SchedulerDoor) else address
        parse_address(address)
        token = token if token is not None else os.environ.get(TOKEN_VARIABLE) or None
        self.address = address
        self._http = httpx.AsyncClient(
            base_url=f"http://{address}",
            headers={"authorization": f"Bearer {token}", **JSON_HEADERS} if token else JSON_HEADERS,
            timeout=httpx.Timeout(CALL_TIMEOUT_SECONDS, connect=5.0),
            limits=httpx.Limits(max_connections=REQUESTS_AT_ONCE, max_keepalive_connections=REQUESTS_AT_ONCE),
        )
        self._places = Batches(lambda inputs: self._send("/place", SchedulerService.place, inputs, PLACES, PLACED))
        self._releases = Batches(
            lambda inputs: self._send("/release", SchedulerService.release, inputs, RELEASES, NOTHING)
        )

    @implements(contracts.place)
    async def place(self, input: PlaceInput) -> PlaceResult:
        result: PlaceResult = await self._places.call(input)
        return result

    @implements(contracts.release)
    async def release(self, input: ReleaseInput) -> None:
        await self._releases.call(input)

    async def _send(
        self,
        path: str,
        handle: Callable[[SchedulerService, Any], Awaitable[Any]],
        inputs: list[Any],
        questions: TypeAdapter[list[Any]],
        answers: TypeAdapter[list[Any]],
    ) -> list[Any]:
        """The answers, in order. Every failure is tried again by the local activities' retry policy, a refusal
        too (a wrong token, a message this scheduler cannot read): the runs wait, and go on once the scheduler is
        mended, rather than fail for a fault of the cluster's set-up. The control plane's log says why."""
        if self._door is None:
            return answers.validate_json(await self._request("POST", path, questions.dump_json(inputs)))
        service = self._door.service
        if service is None:
            raise RuntimeError(f"the scheduler at {self.address} did not answer {path}: {self._door.refusal}")
        return list(await asyncio.gather(*(handle(service, message) for message in inputs)))

    async def usage(self) -> ClusterUse:
        """What the scheduler's placements hold now (`GET /usage`); an error names the scheduler when it does not
        answer, or refuses."""
        return ClusterUse.model_validate_json(await self._request("GET", "/usage"))

    async def _request(self, method: str, path: str, body: bytes | None = None) -> bytes:
        try:
            response = await self._http.request(method, path, content=body)
        except httpx.HTTPError as error:
            raise RuntimeError(f"the scheduler at {self.address} did not answer {path}: {error!r}") from None
        if response.status_code != 200:
            raise RuntimeError(
                f"the scheduler at {self.address} answered {path} with {response.status_code}: {response.text}"
            )
        return response.content

    async def close(self) -> None:
        await self._http.aclose()


class Batches:
    """Calls of one kind, sent in batches: a call leaves at once when fewer than REQUESTS_AT_ONCE requests are in
    flight, else with the calls that wait when one of those returns (up to BATCH_MAX in a request)."""

    def __init__(self, send: Callable[[list[Any]], Awaitable[list[Any]]]) -> None:
        self._send = send
        self._waiting: list[tuple[Any, asyncio.Future[Any]]] = []
        self._sending = 0  # senders draining `_waiting`; each ends, with no await between, once it is empty
        self._senders: set[asyncio.Task[None]] = set()  # referenced while they run

    async def call(self, item: Any) -> Any:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._sending < REQUESTS_AT_ONCE:
            self._sending += 1
            sender = asyncio.ensure_future(self._drain())
            self._senders.add(sender)
            sender.add_done_callback(self._senders.discard)
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting[:BATCH_MAX], self._waiting[BATCH_MAX:]
                try:
                    results = await self._send([item for item, _ in batch])
                except Exception as error:
                    for _, future in batch:
                        if not future.done():  # a call given up (its activity timed out) is not answered
                            future.set_exception(error)
                else:
                    for (_, future), result in zip(batch, results, strict=True):
                        if not future.done():
                            future.set_result(result)
        finally:
            self._sending -= 1
