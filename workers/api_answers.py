"""What the HTTP API takes and answers besides the client's own models: the bodies of its routes, its errors and the
status each is answered with, and what its OpenAPI document says of them (`workers/api.py` has the routes)."""

from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from temporalio.service import RPCError, RPCStatusCode

from workers.errors import AstraeusError, NotFound, SessionRefused
from workflows.domain.run.status import StatusEntry
from workflows.messages import SESSION_OUTPUT_MAX_BYTES, SESSION_TIMEOUT_MAX_SECONDS, SESSION_TTL_MAX_SECONDS


class BadInput(AstraeusError):
    """A request the API cannot read: answered 422, naming the field."""


class Forbidden(AstraeusError):
    """A workspace token asked to change what only an admin may change (machines, quotas)."""


class PortInUse(AstraeusError):
    """The API's port is taken (by another `astraeus api` or `astraeus dev`, say)."""


class Unauthorized(Exception):
    """No token, or one that is not (or no longer) valid: answered 401 and nothing more."""


class Submitted(BaseModel):
    """`POST /jobs`: the run, as `astraeus submit --json` prints it."""

    run: str
    id: str
    namespace: str
    name: str


class History(BaseModel):
    """`GET /jobs/{ns}/{name}/history`: as `astraeus history --json` prints it."""

    run: list[StatusEntry]
    tasks: dict[str, list[StatusEntry]]


class StopRequest(BaseModel):
    reason: str | None = Field(None, max_length=1024, description='why (default "Stopped by scheduler")')


class InteractiveTokenBody(BaseModel):
    ttl_seconds: int = Field(3600, ge=1, le=SESSION_TTL_MAX_SECONDS, description="how long it is valid")


class InteractiveToken(BaseModel):
    """A token for one attempt of a task (made by this API process and kept nowhere: keep it), and its expiry."""

    token: str
    expires_at: datetime


class AttachBody(BaseModel):
    token: str = Field(max_length=128, description="an interactive token issued for the task's current attempt")
    argv: list[str] = Field(min_length=1, max_length=4096, description="the command and its arguments")
    stdin: str = Field("", max_length=SESSION_OUTPUT_MAX_BYTES, description="its input, whole")
    timeout_seconds: float = Field(60, gt=0, le=SESSION_TIMEOUT_MAX_SECONDS)


class CordonBody(BaseModel):
    reason: str = Field("", max_length=1024)


class QuotaBody(BaseModel):
    gpus: int | None = Field(None, ge=0)
    cpu: float | None = Field(None, ge=0)
    memory_bytes: int | None = Field(None, ge=0)
    pools: list[str] = Field(default_factory=list)


class Health(BaseModel):
    ok: bool


class WhoAmI(BaseModel):
    """`GET /whoami`: the token asking, so that a page shows only what it may do (the console's admin forms)."""

    id: str
    namespace: str | None = Field(description="Its workspace; None: an admin token.")
    admin: bool


SPEC_BODY = {
    "required": True,
    "description": "A run spec, as `astraeus submit` reads it: JSON, or YAML with a YAML content type.",
    "content": {
        "application/json": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
        "application/yaml": {"schema": {"$ref": "#/components/schemas/JobSpec"}},
    },
}
WHY = {
    401: "no token, or not a valid one (nothing more is said)",
    403: "only an admin token may change it; an interactive token refused (the error says why)",
    404: "no such run, task or machine, or one the token's workspace may not see",
    409: "the run's state refuses it: it ended, the task is stopping, the name is taken, no machine holds the task",
    422: "bad input, naming the field",
    503: "Temporal stopped answering",
}


def answers(*codes: int, ok: str | None = None) -> dict[int | str, dict[str, Any]]:
    """The answers a route may give besides its own 200 (`ok`: its media type, when it is not JSON)."""
    documented: dict[int | str, dict[str, Any]] = {
        c: {"description": WHY[c]} for c in sorted({401, 404, 422, 503, *codes})
    }
    if ok is not None:
        documented[200] = {"content": {ok: {"schema": {"type": "string"}}}}
    return documented


def answer_errors(app: FastAPI) -> None:
    """How errors read: `{"error": message}`, the CLI's words; 401 says nothing."""

    def answer(status: int) -> Callable[[Request, Exception], Awaitable[Response]]:
        async def handle(request: Request, error: Exception) -> Response:
            return JSONResponse({"error": str(error)}, status_code=status)

        return handle

    async def unauthorized(request: Request, error: Exception) -> Response:
        return Response(status_code=401, headers={"www-authenticate": "Bearer"})

    async def invalid(request: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        lines = [
            f"{'.'.join(str(p) for p in e['loc'] if p not in ('query', 'path'))}: {e['msg']}" for e in error.errors()
        ]
        return JSONResponse({"error": "\n".join(lines)}, status_code=422)

    async def unavailable(request: Request, error: Exception) -> Response:
        assert isinstance(error, RPCError)
        if error.status != RPCStatusCode.UNAVAILABLE:
            raise error
        return JSONResponse({"error": f"Temporal stopped answering: {error}"}, status_code=503)

    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(NotFound, answer(404))
    app.add_exception_handler(Forbidden, answer(403))
    app.add_exception_handler(SessionRefused, answer(403))
    app.add_exception_handler(BadInput, answer(422))
    # What else the client refuses is refused by the run's state: it ended, a worker is stopping, a name is taken.
    app.add_exception_handler(AstraeusError, answer(409))
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(RPCError, unavailable)
