"""The client over the HTTP API: what it sends (a spec the API reads back as the same spec, a workspace token's
spec without a namespace) and how the API's errors read (as AstraeusClient's: NotFound, AstraeusError,
Unreachable). Against a stand-in transport; tests/integration/test_delete.py drives it through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import yaml

from workers.errors import AstraeusError, NotFound, Unreachable
from workers.http_client import HttpClient
from workflows.domain.spec import parse_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
async def test_a_submitted_spec_is_read_by_the_api_as_the_same_spec(path: Path) -> None:
    spec = parse_spec(yaml.safe_load(path.read_text()))
    sent: list[dict[str, object]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        assert request.headers["authorization"] == "Bearer astraeus_t"
        return httpx.Response(201, json={"run": "team-a/x", "id": "job/team-a/x", "namespace": "team-a", "name": "x"})

    async with HttpClient("http://api", "astraeus_t", transport=httpx.MockTransport(answer)) as client:
        assert await client.submit(spec) == "job/team-a/x"
    assert parse_spec(sent[0]) == spec
    assert "namespace" not in sent[0] or "namespace" in yaml.safe_load(path.read_text())  # the token's workspace


@pytest.mark.parametrize(
    ("status", "body", "error", "text"),
    [
        (404, {"error": "no run named x in namespace a"}, NotFound, "no run named x in namespace a"),
        (409, {"error": "run a/x already ended: Cancelled"}, AstraeusError, "run a/x already ended: Cancelled"),
        (401, None, AstraeusError, "the API at http://api refused the token (none given, or not a valid one)"),
        (503, {"error": "Temporal stopped answering: gone"}, Unreachable, "Temporal stopped answering: gone"),
    ],
    ids=["404 is not found", "409 is refused", "401 is a refused token", "503 is unreachable"],
)
async def test_the_apis_errors_read_as_the_clients(
    status: int, body: dict[str, str] | None, error: type[Exception], text: str
) -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))
    async with HttpClient("http://api", None, transport=transport) as client:
        with pytest.raises(error) as raised:
            await client.cancel("a", "x")
    assert str(raised.value) == text and type(raised.value) is error


async def test_an_api_that_does_not_answer_is_unreachable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    async with HttpClient("http://api", "t", transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(Unreachable, match="cannot reach the API at http://api: connection refused"):
            await client.ls()
