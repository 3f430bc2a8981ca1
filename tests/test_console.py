"""The console without a cluster: every pending reason of the spec has a headline and advice (keyed by the codes of
workflows/domain/reasons.py), the API serves the page, its files and the advice without a token, and the page
fetches nothing from elsewhere. The console in a real browser is tests/integration/test_console.py."""

from __future__ import annotations

import re
from typing import cast

from fastapi.testclient import TestClient

from tests.domain.test_reasons import PENDING_REASONS, RUN_REASONS
from workers.api import api_app
from workers.api_auth import TokenBook
from workers.client import AstraeusClient
from workers.console import STATIC
from workers.console.advice import PENDING, RUN_PENDING, table
from workflows.domain.reasons import R


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


def test_an_oom_kill_says_to_raise_memory_bytes_or_per_gpu_memory_bytes() -> None:
    failures = table()["failures"]
    assert list(failures) == ["OOMKilled: the container exceeded its memory limit"]
    assert failures["OOMKilled: the container exceeded its memory limit"]["advice"] == (
        "The worker used more host memory than its limit. Raise memory_bytes (or per_gpu.memory_bytes, which its "
        "GPUs multiply)."
    )
