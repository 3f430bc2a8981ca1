"""The console in a real browser (Debian's chromium, driven by Selenium) against a real cluster and `astraeus api`:
what a person sees. A login with a token; a run going Running in the list without a reload; a waiting run's
headline, advice and What keeps it out; a failing worker's Restarting countdown, then its failure and log tail; a
worker stopped with a reason from the page; Include deleted; a workspace token that sees only its own runs."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import Cluster

pytestmark = pytest.mark.integration

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,1000")  # fmt: skip
if CHROMIUM is None or CHROMEDRIVER is None:
    pytest.skip("no chromium and chromium-driver: `make engine` installs them", allow_module_level=True)

from selenium import webdriver  # noqa: E402  (after the skip: selenium is a test extra)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


class Console:
    """The cluster, its API, a token of each kind, and a browser."""

    def __init__(self, cluster: Cluster, url: str, browser: WebDriver) -> None:
        self.cluster, self.url, self.browser = cluster, url, browser
        self.admin = self.token("--admin")
        self.research = self.token("research")
        self.other = self.token("other")

    def token(self, *args: str) -> str:
        return self.cluster.cli("token", "create", *args).stdout.strip()

    def submit(self, spec: dict[str, Any], token: str | None = None) -> None:
        headers = {"authorization": f"Bearer {token or self.research}"}
        answer = httpx.post(f"{self.url}/jobs", json=spec, headers=headers, timeout=60)
        assert answer.status_code == 201, answer.text

    def login(self, token: str) -> None:
        self.browser.get(f"{self.url}/console/")
        self.browser.execute_script("sessionStorage.clear()")
        self.browser.get(f"{self.url}/console/#/runs")
        box = self.see(By.ID, "token")
        box.send_keys(token)
        self.browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
        self.see(By.ID, "runs")

    def see(self, by: str, what: str, timeout: float = 30) -> Any:
        return WebDriverWait(self.browser, timeout, poll_frequency=0.2).until(
            lambda b: next((e for e in b.find_elements(by, what) if e.is_displayed()), None), f"{what} shown"
        )

    def text(self, css: str, timeout: float = 30, contains: str = "") -> str:
        """The text of the first element matching css, once it contains `contains`."""

        def shown(b: WebDriver) -> str | None:
            for e in b.find_elements(By.CSS_SELECTOR, css):
                try:
                    if contains in e.text and e.is_displayed():
                        return str(e.text)
                except Exception:  # redrawn meanwhile: look again
                    return None
            return None

        return WebDriverWait(self.browser, timeout, poll_frequency=0.2).until(shown, f"{css} with {contains!r}")


@contextlib.contextmanager
def browser(profile: Path) -> Iterator[WebDriver]:
    """Debian's chromium, headless, with a profile of its own (removed after), driven by Debian's chromedriver."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Console]:
    # A back-off long enough to watch its countdown.
    c = Cluster(tmp_path_factory.mktemp("cluster"), backoff_base_seconds=6, backoff_cap_seconds=6)
    try:
        c.start({"a0": ["--gpus", "2xL4-24GB", "--cpus", "4", "--memory-bytes", "16GiB"]})
        url = c.spawn_api()
        with browser(Path(tempfile.mkdtemp(prefix="astraeus-chromium-"))) as driver:
            yield Console(c, url, driver)
    finally:
        c.stop()


def _row(console: Console, run: str, contains: str = "") -> str:
    return console.text(f'#runs-table tr[data-run="{run}"]', contains=contains)


def test_a_run_goes_running_in_the_list_without_a_reload_and_a_worker_is_stopped_from_its_page(
    console: Console,
) -> None:
    console.login(console.research)
    assert "No runs yet" in console.text("#runs .empty")
    console.browser.execute_script("window.notReloaded = true")
    console.submit({"name": "live", "groups": [{"name": "w", "command": ["sh", "-c", "echo hi from live; sleep 60"]}]})
    row = _row(console, "research/live", contains="Running")
    assert "1 / 1" in row and "1 of 1 workers running" in row
    assert console.browser.execute_script("return window.notReloaded") is True

    console.browser.find_element(By.LINK_TEXT, "live").click()
    assert console.text("#run-reason") == "1 of 1 workers running"
    console.see(By.CSS_SELECTOR, 'tr[data-task="w-0"] button.logs').click()
    assert "hi from live" in console.text("#log-text", contains="hi from live")
    console.browser.find_element(By.CSS_SELECTOR, 'tr[data-task="w-0"] button.stop').click()
    reason = console.see(By.ID, "dialog-reason")
    reason.clear()
    reason.send_keys("Making room")
    console.browser.find_element(By.ID, "dialog-yes").click()
    assert "Making room" in console.text("#history", contains="Making room")
    console.text("#run-reason", contains="All workers ended; some were cancelled")


def test_a_waiting_run_says_why_what_to_do_and_what_keeps_it_out(console: Console) -> None:
    console.login(console.research)
    console.submit({"name": "big", "groups": [{"name": "w", "gpus": 8, "command": ["sleep", "60"]}]})
    console.browser.get(f"{console.url}/console/#/runs/research/big")
    assert console.text("#headline") == "No machine can take it right now"
    assert console.text("#advice-text").startswith("No machine passes every check")
    assert console.text("#run-reason") == "No machine fits: 1 of 1 machines ready"
    keeps_out = console.text("#keeps-out tbody tr", contains="insufficient gpus")
    assert keeps_out == "insufficient gpus: need 8, 2 free and usable 1 a0"


def test_a_failing_worker_counts_down_its_restart_then_shows_its_failure_and_log_tail(console: Console) -> None:
    console.login(console.research)
    console.submit({"name": "flaky", "groups": [{"name": "w", "command": ["sh", "-c", "echo boom; exit 3"]}]})
    console.browser.get(f"{console.url}/console/#/runs/research/flaky")
    countdown = console.text('tr[data-task="w-0"] .restarting', contains="Restarting in")
    assert console.text("#headline") == "Restarting after a failure"
    assert 0 < int(countdown.removeprefix("Restarting in ").removesuffix("s")) <= 6
    failure = console.text('tr[data-task="w-0"] .failure', contains="exit 3")
    assert failure.startswith("exit 3: Exited with code 3")
    console.browser.find_element(By.CSS_SELECTOR, 'tr[data-task="w-0"] .failure summary').click()
    assert "boom" in console.text('tr[data-task="w-0"] .log-tail', contains="boom")
    httpx.post(f"{console.url}/jobs/research/flaky/cancel", headers={"authorization": f"Bearer {console.research}"})


def test_include_deleted_and_a_workspace_token_that_sees_only_its_own_runs(console: Console) -> None:
    console.submit({"name": "gone", "groups": [{"name": "w", "command": ["true"], "restart_policy": "Never"}]})
    console.cluster.wait_state("research/gone", "Completed")
    deleted = httpx.delete(f"{console.url}/jobs/research/gone", headers={"authorization": f"Bearer {console.admin}"},
                           timeout=60)  # fmt: skip
    assert deleted.status_code == 200, deleted.text
    console.login(console.research)
    _row(console, "research/live")
    assert not console.browser.find_elements(By.CSS_SELECTOR, 'tr[data-run="research/gone"]')
    console.browser.find_element(By.ID, "include-deleted").click()
    assert "Deleted" in _row(console, "research/gone", contains="Deleted by")

    console.submit({"name": "theirs", "groups": [{"name": "w", "command": ["sleep", "60"]}]}, token=console.other)
    console.login(console.other)
    _row(console, "other/theirs")
    shown = [e.get_attribute("data-run") for e in console.browser.find_elements(By.CSS_SELECTOR, "tr[data-run]")]
    assert shown == ["other/theirs"]
    console.browser.get(f"{console.url}/console/#/runs/research/live")
    assert "no run named live in namespace research" in console.text("#run .empty")
    assert json.loads(console.browser.execute_script("return JSON.stringify(Object.keys(sessionStorage))")) == [
        "astraeus.token"
    ]


def test_an_admin_cordons_and_uncordons_a_machine_and_a_workspace_token_may_not(console: Console) -> None:
    console.login(console.other)
    console.browser.get(f"{console.url}/console/#/machines")
    console.see(By.CSS_SELECTOR, 'tr[data-node="a0"] button').click()
    console.see(By.ID, "dialog-yes").click()
    assert console.text("#status.error", contains="only an admin") == "only an admin token may change machines"

    console.login(console.admin)
    console.browser.get(f"{console.url}/console/#/machines")
    console.see(By.CSS_SELECTOR, 'tr[data-node="a0"] button').click()
    reason = console.see(By.ID, "dialog-reason")
    reason.clear()
    reason.send_keys("disk swap")
    console.browser.find_element(By.ID, "dialog-yes").click()
    assert "disk swap" in console.text('tr[data-node="a0"]', contains="Uncordon")
    console.browser.find_element(By.CSS_SELECTOR, 'tr[data-node="a0"] button').click()
    console.text('tr[data-node="a0"]', contains="Cordon")
    assert "disk swap" not in console.text('tr[data-node="a0"]', contains="Cordon")
