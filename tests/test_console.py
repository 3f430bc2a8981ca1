"""The console without a cluster: every pending reason of the spec has a headline and advice (keyed by the codes of
workflows/domain/reasons.py), the API serves the page, its files and the advice without a token, and the page
fetches nothing from elsewhere. The console in a real browser is tests/integration/test_console.py."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import cast

from fastapi.testclient import TestClient

from tests.domain.test_reasons import PENDING_REASONS, RUN_REASONS
from workers.api import api_app
from workers.api_auth import TokenBook
from workers.client import AstraeusClient
from workers.console import STATIC, USED_LINK, SignIn
from workers.console.advice import PENDING, RUN_PENDING, table
from workflows.domain.reasons import R
from workflows.domain.tokens import Token, digest


def test_every_pending_reason_of_the_spec_has_a_headline_and_advice() -> None:
    codes = {row[0] for row in PENDING_REASONS}  # copied from the spec's pending-reasons table
    assert codes <= set(PENDING), sorted(codes - set(PENDING))
    for code in codes:
        assert PENDING[code].headline.strip() and PENDING[code].advice.strip(), code


def test_the_advice_is_keyed_by_real_codes_of_waiting_reasons() -> None:
    known = {t.code for t in vars(R).values() if hasattr(t, "template")}
    assert set(PENDING) | set(RUN_PENDING) <= known
    assert set(RUN_PENDING) <= {row[0] for row in RUN_REASONS}
    assert set(table()["reasons"]) == set(PENDING) | set(RUN_PENDING)


def test_the_api_serves_the_page_its_files_and_the_advice_without_a_token() -> None:
    app = api_app(cast(AstraeusClient, None), cast(TokenBook, None))
    with TestClient(app) as http:
        page = http.get("/console/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert '<label for="token">API token</label>' in page.text
        assert http.get("/console", follow_redirects=False).headers["location"] == "/console/"
        for name in ("console.js", "console.css"):
            assert http.get(f"/console/{name}").status_code == 200
        advice = http.get("/console/advice.json").json()["reasons"]
        assert advice["NoMachineFits"]["advice"].startswith("No machine passes every check")
        assert http.get("/jobs").status_code == 401  # the API itself still asks for a token


def test_the_page_fetches_nothing_from_elsewhere() -> None:
    for path in STATIC.iterdir():
        text = path.read_text()
        assert not re.search(r"(?:src|href)=\"(?:https?:)?//", text), path.name
        assert not re.search(r"(?:fetch|import)\(\s*[\"'`](?:https?:)?//", text), path.name


def test_a_sign_in_link_signs_in_once_and_says_why_it_does_not_again() -> None:
    sign_in = SignIn()
    code = sign_in.link("astraeus_secret")
    app = api_app(cast(AstraeusClient, None), cast(TokenBook, None), sign_in=sign_in, temporal_ui="http://ui:8233")
    with TestClient(app) as http:
        first = http.post("/console/sign-in", json={"code": code})
        assert (first.status_code, first.json(), first.headers["cache-control"]) == (
            200,
            {"token": "astraeus_secret"},
            "no-store",
        )
        again = http.post("/console/sign-in", json={"code": code})
        assert (again.status_code, again.json()) == (401, {"error": USED_LINK})
        assert http.post("/console/sign-in", json={"code": "made-up"}).status_code == 401
        assert http.get("/console/config.json").json() == {
            "temporal_ui": "http://ui:8233",
            "temporal_namespace": "default",
        }


def test_without_sign_in_links_every_code_is_refused() -> None:
    app = api_app(cast(AstraeusClient, None), cast(TokenBook, None))
    with TestClient(app) as http:
        assert http.post("/console/sign-in", json={"code": "anything"}).json() == {"error": USED_LINK}
        assert http.get("/console/config.json").json() == {"temporal_ui": None, "temporal_namespace": "default"}


class Book(TokenBook):
    """Tokens without Temporal: a workspace token and an admin's, by their secrets."""

    def __init__(self) -> None:
        at = datetime(2026, 12, 1, tzinfo=UTC)
        self.known = {
            "ws-secret": Token(id="tok-0000000a", namespace="research", sha256=digest("ws-secret"), created_at=at),
            "admin-secret": Token(id="tok-0000000b", namespace=None, sha256=digest("admin-secret"), created_at=at),
        }

    async def find(self, secret: str) -> Token | None:
        return self.known.get(secret)


def test_whoami_tells_the_page_whether_its_token_is_an_admins() -> None:
    app = api_app(cast(AstraeusClient, None), Book())
    with TestClient(app) as http:
        ws = http.get("/whoami", headers={"authorization": "Bearer ws-secret"})
        assert ws.json() == {"id": "tok-0000000a", "namespace": "research", "admin": False}
        admin = http.get("/whoami", headers={"authorization": "Bearer admin-secret"})
        assert admin.json() == {"id": "tok-0000000b", "namespace": None, "admin": True}
        assert http.get("/whoami").status_code == 401


def test_the_free_room_comes_from_the_schedulers_door_and_from_the_runs_while_it_does_not_answer() -> None:
    """The console's pages ask for it every 2 s: one call to the scheduler, not a query of every open run. A
    scheduler that does not answer is asked again only after a while; meanwhile the runs are read."""
    from types import SimpleNamespace

    from activities.scheduler_link import SchedulerLink
    from workflows.domain.scheduling.use import ClusterUse, WorkspaceUse

    def use(gpus: int) -> ClusterUse:
        return ClusterUse(machines=[], workspaces=[WorkspaceUse(namespace="a", gpus=gpus, cpu=0, memory_bytes=0,
                                                                workers=1)])  # fmt: skip

    class Scheduler:
        calls = 0
        answers = True

        async def usage(self) -> ClusterUse:
            self.calls += 1
            if not self.answers:
                raise RuntimeError("the scheduler at 127.0.0.1:7244 did not answer /usage: ConnectError()")
            return use(8)

    class Runs:
        calls = 0
        temporal = SimpleNamespace(namespace="default")  # the console's links to the Temporal UI name it

        async def usage(self) -> ClusterUse:
            self.calls += 1
            return use(3)

    scheduler, runs = Scheduler(), Runs()
    app = api_app(cast(AstraeusClient, runs), Book(), scheduler=cast(SchedulerLink, scheduler))
    with TestClient(app) as http:

        def asked() -> int:
            answer = http.get("/usage", headers={"authorization": "Bearer admin-secret"})
            return int(answer.json()["workspaces"][0]["gpus"])

        assert [asked(), asked()] == [8, 8] and (scheduler.calls, runs.calls) == (2, 0)
        scheduler.answers = False
        assert [asked(), asked()] == [3, 3] and (scheduler.calls, runs.calls) == (3, 2)


def test_an_oom_kill_says_to_raise_memory_bytes_or_per_gpu_memory_bytes() -> None:
    failures = table()["failures"]
    assert list(failures) == ["OOMKilled: the container exceeded its memory limit"]
    assert failures["OOMKilled: the container exceeded its memory limit"]["advice"] == (
        "The worker used more host memory than its limit. Raise memory_bytes (or per_gpu.memory_bytes, which its "
        "GPUs multiply)."
    )
