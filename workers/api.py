"""The HTTP API (`astraeus api`): the CLI's verbs over HTTP, in the API's words (a run is a job, a worker a task).

A thin adapter: every route is one call of `AstraeusClient` (or of the admin verbs) and answers what that call
answers, as `--json` prints it; what the API adds is who may ask (`workers/api_auth.py`) and how errors read
(`{"error": ...}` with 401, 403, 404, 409, 422 or 503). A workspace token sees only its workspace's runs: for any
other run the answer is 404, word for word what a run that does not exist gets.
"""

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal, cast

import yaml
from fastapi import Depends, FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import ValidationError

from activities.scheduler_link import SchedulerLink
from workers import admin, console
from workers.api_answers import (
    SPEC_BODY,
    AttachBody,
    BadInput,
    CordonBody,
    Forbidden,
    Health,
    History,
    InteractiveToken,
    InteractiveTokenBody,
    QuotaBody,
    StopRequest,
    Submitted,
    Unauthorized,
    WhoAmI,
    answer_errors,
    answers,
)
from workers.api_auth import TokenBook
from workers.client import AstraeusClient
from workers.console import SignIn
from workers.errors import NotFound
from workers.listing import RunPage
from workflows.domain.constraints import Drive
from workflows.domain.drives import NewDrive
from workflows.domain.group_parts import NAME_PATTERN
from workflows.domain.inventory import NodeView
from workflows.domain.run.status import RunState, Status
from workflows.domain.run.views import TERMINATED, JobDescription, TaskView
from workflows.domain.scheduling.quotas import Quota
from workflows.domain.scheduling.use import ClusterUse
from workflows.domain.spec import JobSpec, format_errors, parse_spec
from workflows.domain.tokens import Token, may_see
from workflows.domain.tombstones import DELETED, Tombstone
from workflows.messages import Attached, DataLocationRequest

log = logging.getLogger("astraeus.api")
SCHEDULER_AWAY_SECONDS = 30.0
RUN_STATES = [*(s.value for s in RunState), TERMINATED]
SSE = "text/event-stream"
YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml")


class Usage:
    """The machines' free room and the workspaces' use, from the scheduler's own view: one call, however many runs
    (the console's pages ask every 2 s). Read from each open run, one query each, when no scheduler is given or
    it did not answer (restarting, say) in the last SCHEDULER_AWAY_SECONDS."""

    def __init__(self, client: AstraeusClient, scheduler: SchedulerLink | None) -> None:
        self._client, self._scheduler = client, scheduler
        self._away_until = 0.0

    async def __call__(self) -> ClusterUse:
        if self._scheduler is not None and time.monotonic() >= self._away_until:
            try:
                return await self._scheduler.usage()
            except RuntimeError as error:
                self._away_until = time.monotonic() + SCHEDULER_AWAY_SECONDS
                log.warning("%s: counting what the open runs hold instead", error)
        return await self._client.usage()


def api_app(
    client: AstraeusClient,
    book: TokenBook,
    *,
    sign_in: SignIn | None = None,
    temporal_ui: str | None = None,
    scheduler: SchedulerLink | None = None,
) -> FastAPI:
    """The API over one client of Temporal; `book` says who each bearer token is. The console it serves links to
    `temporal_ui` (the Temporal UI's URL) when given, and takes `sign_in`'s one-time links (`astraeus dev`). The
    machines' free room comes from the `scheduler`'s door when given (one call), else from every open run."""
    cluster_use = Usage(client, scheduler)
    app = FastAPI(title="Astraeus", version="1", summary="Runs (jobs) and their workers (tasks) on a GPU cluster.")
    bearer = HTTPBearer(auto_error=False, description="A workspace token, or an admin token (astraeus token create)")

    async def caller(given: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> Token:
        token = await book.find(given.credentials) if given is not None else None
        if token is None:
            raise Unauthorized
        return token

    Caller = Annotated[Token, Depends(caller)]

    def visible(token: Token, ns: str, name: str) -> None:
        if not may_see(token, ns):  # the same words as a run that does not exist
            raise NotFound(f"no run named {name} in namespace {ns}")

    def admin_only(token: Token, what: str) -> None:
        if not token.admin:
            raise Forbidden(f"only an admin token may change {what}")

    answer_errors(app)

    @app.get("/healthz", response_model=Health, tags=["health"])
    async def healthz() -> Health:
        """Whether the API process answers (it needs no token)."""
        return Health(ok=True)

    @app.get("/whoami", response_model=WhoAmI, tags=["health"], responses=answers())
    async def whoami(token: Caller) -> WhoAmI:
        """The token asking: its id, its workspace (None: an admin token) and whether it is an admin's."""
        return WhoAmI(id=token.id, namespace=token.namespace, admin=token.admin)

    @app.post("/jobs", status_code=201, response_model=Submitted, tags=["jobs"], responses=answers(409),
              openapi_extra={"requestBody": SPEC_BODY})  # fmt: skip
    async def submit(request: Request, token: Caller) -> Submitted:
        """Submit a run. A workspace token's runs go to its workspace (a spec naming another is refused as
        not found); the spec is checked as `astraeus submit` checks it."""
        spec = _spec(await request.body(), request.headers.get("content-type", ""), token)
        await client.submit(spec)
        run = f"{spec.namespace}/{spec.name}"
        return Submitted(run=run, id=spec.job_id, namespace=spec.namespace, name=spec.name)

    @app.get("/jobs", response_model=RunPage, tags=["jobs"], responses=answers())
    async def list_jobs(
        token: Caller,
        namespace: str | None = Query(None, pattern=NAME_PATTERN),
        state: str | None = Query(None, description=f"one of {', '.join(RUN_STATES)}"),
        limit: int = Query(100, ge=1, le=1000),
        page: str | None = Query(None, description="next_page of the page before"),
        include_deleted: bool = Query(False, description="also deleted runs, as Deleted, after the others"),
    ) -> RunPage:
        """Runs, open ones first, then the latest to end: a workspace token's of its workspace only. Deleted runs
        only with include_deleted: who deleted each, when, and its last state."""
        if state is not None and state not in RUN_STATES and not (include_deleted and state == DELETED):
            raise BadInput(f"state: expected one of {', '.join(RUN_STATES)}")
        if token.namespace is not None:
            if namespace not in (None, token.namespace):
                return RunPage(runs=[])
            namespace = token.namespace
        return await client.ls(namespace, state, limit=limit, page=page, include_deleted=include_deleted)

    @app.get("/jobs/{ns}/{name}", response_model=JobDescription, tags=["jobs"], responses=answers())
    async def describe(
        ns: str, name: str, token: Caller, after: int = Query(0, ge=0), limit: int | None = Query(None, ge=1)
    ) -> JobDescription:
        """The run, its tasks and why they wait, as `astraeus describe --json` (each history paged by after/limit)."""
        visible(token, ns, name)
        return await client.describe(ns, name, after=after, limit=limit)

    @app.delete("/jobs/{ns}/{name}", response_model=Tombstone, tags=["jobs"], responses=answers())
    async def delete(ns: str, name: str, token: Caller) -> Tombstone:
        """Delete the run: an active one is cancelled first (its tasks stopped with "Run deleted"); its tasks' files
        and logs are removed on their nodes, and nothing of it is served any more but its tombstone (GET
        /jobs?include_deleted=true). Its name is free again. Answers once it is done."""
        visible(token, ns, name)
        return await client.delete(ns, name, by=f"token {token.id}")

    @app.post("/jobs/{ns}/{name}/cancel", response_model=Status, tags=["jobs"], responses=answers(409))
    async def cancel(ns: str, name: str, token: Caller) -> Status:
        """Cancel the run: every task is stopped, and the run ends Cancelled."""
        visible(token, ns, name)
        return await client.cancel(ns, name)

    @app.get("/jobs/{ns}/{name}/history", response_model=History, tags=["jobs"], responses=answers())
    async def history(
        ns: str, name: str, token: Caller, after: int = Query(0, ge=0), limit: int | None = Query(None, ge=1)
    ) -> History:
        """Every change of the run, then of each task, oldest first."""
        visible(token, ns, name)
        described = await client.describe(ns, name, after=after, limit=limit)
        return History(run=described.history, tasks={t.id: t.history for t in described.tasks})

    @app.get("/jobs/{ns}/{name}/events", tags=["jobs"], responses=answers(ok=SSE),
             response_class=StreamingResponse)  # fmt: skip
    async def events(
        ns: str, name: str, token: Caller, request: Request, after: int = Query(0, ge=0)
    ) -> StreamingResponse:
        """Server-Sent Events: each change of the run and its tasks (state, reason, code, at), from the first (or
        after `after`, or the `Last-Event-ID` header), until the run ends; then one `end` event with its status."""
        visible(token, ns, name)
        skip = max(after, _last_event_id(request))
        stream = _sse(client, ns, name, skip)
        return StreamingResponse(await _primed(stream), media_type=SSE, headers={"cache-control": "no-cache"})

    @app.get("/jobs/{ns}/{name}/tasks/{task}", response_model=TaskView, tags=["tasks"], responses=answers())
    async def task(ns: str, name: str, task: str, token: Caller) -> TaskView:
        """One task: its node, attempt, restarts, status, history and last failure."""
        visible(token, ns, name)
        return await _task(client, ns, name, task)

    @app.post("/jobs/{ns}/{name}/tasks/{task}/stop", response_model=Status, tags=["tasks"],
              responses=answers(409))  # fmt: skip
    async def stop(ns: str, name: str, task: str, token: Caller, body: StopRequest | None = None) -> Status:
        """Stop one task with a reason (default "Stopped by scheduler"); the run's status after."""
        visible(token, ns, name)
        return await client.stop(ns, name, task, (body or StopRequest()).reason)

    @app.post("/tasks/{full:path}/stop", response_model=Status, tags=["tasks"], responses=answers(409))
    async def stop_by_full_name(full: str, token: Caller, body: StopRequest | None = None) -> Status:
        """The spec's form: the task named in full, `NAMESPACE/RUN/TASK` (or `job/NAMESPACE/RUN/TASK`, its
        run's workflow id and the task)."""
        ns, name, task = _full_task(full)
        visible(token, ns, name)
        return await client.stop(ns, name, task, (body or StopRequest()).reason)

    @app.get("/jobs/{ns}/{name}/tasks/{task}/logs", tags=["tasks"], response_class=PlainTextResponse,
             responses=answers(409, ok="text/plain"))  # fmt: skip
    async def logs(
        ns: str,
        name: str,
        task: str,
        token: Caller,
        tail: int | None = Query(None, ge=1, description="only the last lines"),
        follow: bool = Query(False, description="stream new output until the task ends for good"),
    ) -> Response:
        """The task's output (stdout and stderr), read on its machine; `follow` streams it as it comes."""
        visible(token, ns, name)
        if follow:
            if tail is not None:
                raise BadInput("tail: does not apply with follow")
            text = client.follow_logs(ns, name, task)
            return StreamingResponse(await _primed(text), media_type="text/plain; charset=utf-8")
        return PlainTextResponse(await client.logs(ns, name, task, lines=tail or 100_000))

    @app.post("/jobs/{ns}/{name}/tasks/{task}/interactive-token", response_model=InteractiveToken, tags=["tasks"],
              responses=answers(403, 409))  # fmt: skip
    async def interactive_token(
        ns: str, name: str, task: str, token: Caller, body: InteractiveTokenBody | None = None
    ) -> InteractiveToken:
        """A token with which a person runs commands in the running task (`capabilities.interactive_token`), for
        its current attempt; its machine is told only its public half."""
        visible(token, ns, name)
        made, expires = await client.interactive_token(ns, name, task, (body or InteractiveTokenBody()).ttl_seconds)
        return InteractiveToken(token=made, expires_at=expires)

    @app.post("/jobs/{ns}/{name}/tasks/{task}/attach", response_model=Attached, tags=["tasks"],
              responses=answers(403, 409))  # fmt: skip
    async def attach(ns: str, name: str, task: str, token: Caller, body: AttachBody) -> Attached:
        """Run a command in the running task with an interactive token issued for it: its exit code and output
        (403 when the token is refused, saying why)."""
        visible(token, ns, name)
        return await client.attach(ns, name, task, body.token, body.argv, body.stdin, body.timeout_seconds)

    @app.get("/nodes", response_model=list[NodeView], tags=["nodes"], responses=answers())
    async def nodes(token: Caller) -> list[NodeView]:
        """Every machine: inventory, state and what keeps work off it."""
        return await client.nodes()

    @app.get("/usage", response_model=ClusterUse, tags=["nodes"], responses=answers())
    async def usage(token: Caller) -> ClusterUse:
        """Each machine's free room (its capacity less what its placed workers hold, as the scheduler counts it)
        and each workspace's use (as its quota counts it). A workspace token sees its own workers on each machine,
        and only how many others there are."""
        use = await cluster_use()
        if token.namespace is None:
            return use
        return use.model_copy(update={"machines": [m.seen_by(token.namespace) for m in use.machines]})

    @app.get("/nodes/{node}", response_model=NodeView, tags=["nodes"], responses=answers())
    async def node(node: str, token: Caller) -> NodeView:
        found = next((v for v in await client.nodes() if v.name == node), None)
        if found is None:
            raise NotFound(f"no machine named {node}")
        return found

    @app.post("/nodes/{node}/{verb}", response_model=NodeView, tags=["nodes"], responses=answers(403))
    async def node_verb(
        node: str, verb: Literal["cordon", "uncordon", "remove"], token: Caller, body: CordonBody | None = None
    ) -> NodeView:
        """cordon, uncordon or remove a machine (admin tokens only), as `astraeus nodes VERB`."""
        admin_only(token, "machines")
        return await admin.node_verb(client.temporal, node, verb, (body or CordonBody()).reason)

    @app.put("/nodes/{node}/data-location", response_model=NodeView, tags=["nodes"], responses=answers(403, 409))
    async def set_data_location(node: str, body: DataLocationRequest, token: Caller) -> NodeView:
        """Choose where a machine keeps copies of drives (admin tokens only), as `astraeus nodes data-location`;
        refused (409) when its agent finds no such directory there, or does not answer."""
        admin_only(token, "machines")
        return await admin.set_data_location(client.temporal, node, body.path)

    @app.get("/drives", response_model=list[Drive], tags=["drives"], responses=answers())
    async def drives(token: Caller) -> list[Drive]:
        """The catalogue of drives, as `astraeus drive ls`."""
        return await client.drives()

    @app.post("/drives", response_model=list[Drive], tags=["drives"], responses=answers(403, 409))
    async def create_drive(body: NewDrive, token: Caller) -> list[Drive]:
        """Add a drive (admin tokens only), as `astraeus drive create`; every drive after. 409: the name is taken."""
        admin_only(token, "drives")
        return await admin.create_drive(client.temporal, body)

    @app.delete("/drives/{name}", response_model=list[Drive], tags=["drives"], responses=answers(403, 409))
    async def remove_drive(name: str, token: Caller) -> list[Drive]:
        """Remove a drive (admin tokens only), as `astraeus drive rm`. 409: runs use it (they are named)."""
        admin_only(token, "drives")
        return await admin.remove_drive(client.temporal, name)

    @app.get("/quotas", response_model=list[Quota], tags=["quotas"], responses=answers())
    async def quotas(token: Caller) -> list[Quota]:
        """Every workspace's quota."""
        return await admin.quotas(client.temporal)

    @app.put("/quotas/{ns}", response_model=list[Quota], tags=["quotas"], responses=answers(403))
    async def set_quota(ns: str, body: QuotaBody, token: Caller) -> list[Quota]:
        """Set a workspace's quota (admin tokens only); every quota after."""
        admin_only(token, "quotas")
        try:
            quota = Quota(namespace=ns, gpus=body.gpus, cpu=body.cpu, memory_bytes=body.memory_bytes,
                          pools=tuple(body.pools))  # fmt: skip
        except ValidationError as error:
            raise BadInput(format_errors(error)) from None
        return await admin.set_quota(client.temporal, quota)

    @app.delete("/quotas/{ns}", response_model=list[Quota], tags=["quotas"], responses=answers(403))
    async def remove_quota(ns: str, token: Caller) -> list[Quota]:
        """Remove a workspace's quota (admin tokens only)."""
        admin_only(token, "quotas")
        return await admin.remove_quota(client.temporal, ns)

    namespace = client.temporal.namespace if client is not None else "default"
    console.mount(app, sign_in=sign_in, temporal_ui=temporal_ui, temporal_namespace=namespace)
    app.openapi = lambda: openapi(app)  # type: ignore[method-assign]
    return app


def openapi_document() -> dict[str, Any]:
    """The document without a cluster: it depends on the routes only (deploy/openapi.json is it)."""
    return openapi(api_app(cast(AstraeusClient, None), cast(TokenBook, None)))


def openapi(app: FastAPI) -> dict[str, Any]:
    """The API's OpenAPI document, with the run spec's JSON Schema (the body of POST /jobs) among its schemas."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        spec = JobSpec.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        schemas.update(spec.pop("$defs", {}))
        schemas["JobSpec"] = spec
        app.openapi_schema = document
    return app.openapi_schema


# ---- what the routes share --------------------------------------------------------------------------------------


def _spec(body: bytes, content_type: str, token: Token) -> JobSpec:
    """The run spec of a POST /jobs, read as the CLI reads a file (YAML with a YAML content type, else JSON);
    a workspace token's spec goes to its workspace."""
    try:
        yaml_given = content_type.split(";")[0].strip().lower() in YAML_TYPES
        data = yaml.safe_load(body) if yaml_given else json.loads(body)
    except (yaml.YAMLError, ValueError) as error:
        raise BadInput(f"body: not {'YAML' if yaml_given else 'JSON'}: {error}") from None
    if isinstance(data, dict) and token.namespace is not None:
        given = data.setdefault("namespace", token.namespace)
        if given != token.namespace:
            raise NotFound(f"no namespace {given} for this token")
    try:
        return parse_spec(data)
    except ValueError as error:
        raise BadInput(f"invalid run spec:\n{error}") from None


def _full_task(full: str) -> tuple[str, str, str]:
    """`NAMESPACE/RUN/TASK`, or `job/NAMESPACE/RUN/TASK`."""
    parts = full.split("/")
    if len(parts) == 4 and parts[0] == "job":
        parts = parts[1:]
    if len(parts) != 3 or not all(parts):
        raise BadInput(f"{full}: expected NAMESPACE/RUN/TASK, e.g. default/hello/worker-0")
    return parts[0], parts[1], parts[2]


async def _task(client: AstraeusClient, ns: str, name: str, task: str) -> TaskView:
    described = await client.describe(ns, name)
    found = next((t for t in described.tasks if t.id == task), None)
    if found is None:
        raise NotFound(f"run {ns}/{name} has no worker {task}")
    return found


def _last_event_id(request: Request) -> int:
    """A reconnecting EventSource sends the id of the last event it had: it goes on after it."""
    given = request.headers.get("last-event-id", "")
    return int(given) if given.isdigit() else 0


async def _sse(client: AstraeusClient, ns: str, name: str, skip: int) -> AsyncIterator[str]:
    """Each event as `id: N` (its place in the run's event stream, from 1) and `data: {json}`, until the run ends;
    then `event: end` with the run's status."""
    number = 0
    async for event in client.follow(ns, name):
        number += 1
        if number > skip:
            yield f"id: {number}\ndata: {event.model_dump_json()}\n\n"
    status = await client.status(ns, name)
    yield f"event: end\ndata: {status.model_dump_json()}\n\n"


async def _primed(stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """The stream with its first item read already, so that a run or task that does not exist is answered with
    its error (404) rather than a 200 that breaks off."""
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None

    async def rest() -> AsyncIterator[str]:
        if first is not None:
            yield first
        async for item in stream:
            yield item

    return rest()
