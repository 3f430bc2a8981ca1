"""The Python client over the HTTP API: AstraeusClient's verbs (submit, ls, status, describe, events, result,
follow, cancel, stop, logs, nodes, delete) for a person who has a token of the API (`astraeus token create`) and no
access to the Temporal frontend. The CLI uses it with `--api URL --token T` (or $ASTRAEUS_API_URL, $ASTRAEUS_TOKEN).

Each verb is one route and answers what AstraeusClient answers, with the same errors: 404 is NotFound, 409 and 422
are AstraeusError (the API's words), no answer is Unreachable. Use it as `async with HttpClient(url, token) as c:`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
from pydantic import TypeAdapter

from workers.errors import AstraeusError, NotFound, Unreachable
from workers.listing import RunPage
from workflows.domain.inventory import NodeView
from workflows.domain.run.status import RUN_TERMINAL, Status
from workflows.domain.run.views import TERMINATED, Event, JobDescription, page
from workflows.domain.run.views import events as events_of
from workflows.domain.spec import JobSpec
from workflows.domain.tombstones import Tombstone

_NODES = TypeAdapter(list[NodeView])
_EVENT = TypeAdapter(Event)


class HttpClient:
    """Astraeus's verbs over the HTTP API at `url`, as the holder of `token` (a workspace's, or an admin's)."""

    def __init__(self, url: str, token: str | None, *, timeout: float = 120.0, transport: Any = None) -> None:
        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    async def __aenter__(self) -> HttpClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **options: Any) -> httpx.Response:
        try:
            answer = await self._http.request(method, path, **options)
        except httpx.TransportError as error:
            raise Unreachable(f"cannot reach the API at {self.url}: {error}") from None
        _check(answer, self.url)
        return answer

    async def submit(self, spec: JobSpec) -> str:
        """Submit the run (a workspace token's goes to its workspace); its id, `job/<ns>/<name>`."""
        body = spec.model_dump(mode="json", exclude_unset=True)
        answer = await self._call("POST", "/jobs", json=body)
        return str(answer.json()["id"])

    async def ls(
        self,
        namespace: str | None = None,
        state: str | None = None,
        *,
        limit: int = 100,
        page: str | None = None,
        include_deleted: bool = False,
    ) -> RunPage:
        params: dict[str, Any] = {"limit": limit}
        for key, value in (("namespace", namespace), ("state", state), ("page", page)):
            if value is not None:
                params[key] = value
        if include_deleted:
            params["include_deleted"] = "true"
        return RunPage.model_validate((await self._call("GET", "/jobs", params=params)).json())

    async def status(self, namespace: str, name: str) -> Status:
        return (await self.describe(namespace, name)).status

    async def describe(self, namespace: str, name: str, *, after: int = 0, limit: int | None = None) -> JobDescription:
        params: dict[str, Any] = {"after": after} | ({"limit": limit} if limit is not None else {})
        answer = await self._call("GET", f"/jobs/{namespace}/{name}", params=params)
        return JobDescription.model_validate(answer.json())

    async def events(self, namespace: str, name: str, *, after: int = 0, limit: int | None = None) -> list[Event]:
        """Every change of the run and its workers, oldest first, derived from its whole histories as served."""
        return page(events_of(await self.describe(namespace, name)), after, limit)

    async def result(self, namespace: str, name: str, poll_seconds: float = 1.0) -> Status:
        """Wait until the run ends; its final Status."""
        while True:
            status = await self.status(namespace, name)
            if status.state in RUN_TERMINAL or status.state == TERMINATED:
                return status
            await asyncio.sleep(poll_seconds)

    async def follow(self, namespace: str, name: str, poll_seconds: float = 0.5) -> AsyncIterator[Event]:
        """Every event, then new ones as they come, until the run ends (the API's Server-Sent Events)."""
        async with self._http.stream("GET", f"/jobs/{namespace}/{name}/events") as answer:
            if answer.status_code != 200:
                await answer.aread()
                _check(answer, self.url)
            kind, data = "message", ""
            async for line in answer.aiter_lines():
                if line.startswith("event: "):
                    kind = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    data = line.removeprefix("data: ")
                elif not line and data:
                    if kind == "end":
                        return
                    yield _EVENT.validate_json(data)
                    kind, data = "message", ""

    async def cancel(self, namespace: str, name: str) -> Status:
        return Status.model_validate((await self._call("POST", f"/jobs/{namespace}/{name}/cancel")).json())

    async def stop(self, namespace: str, name: str, task_id: str, reason: str | None = None) -> Status:
        path = f"/jobs/{namespace}/{name}/tasks/{task_id}/stop"
        return Status.model_validate((await self._call("POST", path, json={"reason": reason})).json())

    async def delete(self, namespace: str, name: str, by: str = "") -> Tombstone:
        """Delete the run (the API records the token as who deleted it; `by` is not sent)."""
        return Tombstone.model_validate((await self._call("DELETE", f"/jobs/{namespace}/{name}")).json())

    async def logs(
        self, namespace: str, name: str, task_id: str, lines: int = 100_000, max_bytes: int = 1 << 20
    ) -> str:
        path = f"/jobs/{namespace}/{name}/tasks/{task_id}/logs"
        return (await self._call("GET", path, params={"tail": lines})).text

    async def follow_logs(
        self, namespace: str, name: str, task_id: str, poll_seconds: float = 1.0
    ) -> AsyncIterator[str]:
        path = f"/jobs/{namespace}/{name}/tasks/{task_id}/logs"
        async with self._http.stream("GET", path, params={"follow": "true"}) as answer:
            if answer.status_code != 200:
                await answer.aread()
                _check(answer, self.url)
            async for text in answer.aiter_text():
                yield text

    async def nodes(self) -> list[NodeView]:
        return _NODES.validate_python((await self._call("GET", "/nodes")).json())


def _check(answer: httpx.Response, url: str) -> None:
    """The API's errors as the client's: 404 NotFound, 401 a refused token, 503 Unreachable, else AstraeusError."""
    if answer.status_code < 400:
        return
    if answer.status_code == 401:
        raise AstraeusError(f"the API at {url} refused the token (none given, or not a valid one)")
    try:
        said = str(json.loads(answer.content)["error"])
    except (ValueError, KeyError, TypeError):
        said = f"HTTP {answer.status_code}: {answer.text[:200]}"
    if answer.status_code == 404:
        raise NotFound(said)
    if answer.status_code == 503:
        raise Unreachable(said)
    raise AstraeusError(said)
