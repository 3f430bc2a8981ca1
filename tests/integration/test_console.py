"""The console in a real browser (Debian's chromium, driven by Selenium) against a real cluster and `astraeus api`:
what a person sees. A login with a token; a run going Running in the list without a reload; a waiting run's
headline, advice and What keeps it out; a failing worker's Restarting countdown, then its failure and log tail; a
worker stopped with a reason from the page; a run cancelled and one deleted from its page, each confirmed first;
logs followed as they come; Include deleted; a workspace token that sees only its own runs; machines with their free
room, the workers on them and their history, cordoned, uncordoned and removed by an admin; a machine's data location
chosen by an admin from its page (the run's advice links there), a bad one refused in the server's words, and the
catalogue of drives; no accessibility
violation axe-core finds, and a page worked with the keyboard alone; and the new user's way in: `astraeus dev`'s
printed console address, which signs in once, then the README's examples submitted and their wait explained."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import httpx
import pytest

from tests.integration.harness import ASTRAEUS, Cluster, end_group
from workers.console import USED_LINK
from workers.devserver import free_port

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
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402
from selenium_axe_python import Axe  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
VIEWER_ZONE = "Asia/Kolkata"  # UTC+05:30 all year


class Page:
    """A browser, and what a person waits for on its page."""

    def __init__(self, browser: WebDriver) -> None:
        self.browser = browser

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

    def until(self, check: Any, what: str, timeout: float = 30) -> Any:
        return WebDriverWait(self.browser, timeout, poll_frequency=0.2).until(lambda b: check(), what)


class Console(Page):
    """The cluster, its API, a token of each kind, and a browser."""

    def __init__(self, cluster: Cluster, url: str, browser: WebDriver) -> None:
        super().__init__(browser)
        self.cluster, self.url = cluster, url
        self.admin = self.token("--admin")
        self.research = self.token("research")
        self.other = self.token("other")

    def token(self, *args: str) -> str:
        return self.cluster.cli("token", "create", *args).stdout.strip()

    def submit(self, spec: dict[str, Any], token: str | None = None) -> None:
        headers = {"authorization": f"Bearer {token or self.research}"}
        answer = httpx.post(f"{self.url}/jobs", json=spec, headers=headers, timeout=60)
        assert answer.status_code == 201, answer.text

    def get(self, path: str, token: str | None = None) -> Any:
        answer = httpx.get(f"{self.url}{path}", headers={"authorization": f"Bearer {token or self.admin}"}, timeout=60)
        assert answer.status_code == 200, answer.text
        return answer.json()

    def login(self, token: str) -> None:
        self.browser.get(f"{self.url}/console/")
        self.browser.execute_script("sessionStorage.clear()")
        self.browser.get(f"{self.url}/console/#/runs")
        box = self.see(By.ID, "token")
        box.send_keys(token)
        self.browser.find_element(By.CSS_SELECTOR, "#login button[type=submit]").click()
        self.see(By.ID, "runs", timeout=60)  # the first page after signing in: slow on a busy machine

    def open(self, hash_: str) -> None:
        self.browser.get(f"{self.url}/console/{hash_}")


@contextlib.contextmanager
def browser(profile: Path) -> Iterator[WebDriver]:
    """Debian's chromium, headless, with a profile of its own (removed after), driven by Debian's chromedriver; in a
    zone that is not UTC (VIEWER_ZONE), as a viewer elsewhere sees the page."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}", "--lang=en-US"):
        options.add_argument(flag)
    service = Service(executable_path=str(CHROMEDRIVER), env={**os.environ, "TZ": VIEWER_ZONE})
    driver = webdriver.Chrome(options=options, service=service)
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
    # Times in the viewer's zone, in UTC on hover.
    first = console.see(By.CSS_SELECTOR, "#history time")
    at = datetime.strptime(first.get_attribute("title"), "%Y-%m-%d %H:%M:%S UTC").replace(tzinfo=UTC)
    local = at.astimezone(ZoneInfo(VIEWER_ZONE))
    assert first.text == f"{local.month}/{local.day}/{local.year}, {local.strftime('%-I:%M:%S %p')}"
    console.see(By.CSS_SELECTOR, "#how summary").click()  # how the per-machine reasons are read
    assert console.text("#how p").startswith("The scheduler checks every machine in a fixed order, cheap checks first")


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
    console.see(By.CSS_SELECTOR, 'tr[data-node="a0"]')
    assert not console.browser.find_elements(By.CSS_SELECTOR, 'tr[data-node="a0"] button')  # a workspace's token
    assert console.get("/nodes/a0")["cordon"] is None

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


def test_logs_are_followed_as_they_come_and_a_run_is_cancelled_from_its_page_once_confirmed(console: Console) -> None:
    console.submit({"name": "ticking", "groups": [{"name": "w", "command": [
        "sh", "-c", "i=0; while true; do i=$((i+1)); echo tick $i; sleep 1; done"]}]})  # fmt: skip
    console.cluster.wait_state("research/ticking", "Running")
    console.login(console.research)
    console.open("#/runs/research/ticking")
    console.see(By.CSS_SELECTOR, 'tr[data-task="w-0"] button.follow').click()
    first = console.text("#log-text", contains="tick 1")
    later = console.text("#log-text", contains=f"tick {len(first.splitlines()) + 2}")  # more came, without a click
    assert later.startswith(first)
    assert console.text("#logs-title") == "Logs of w-0, following"

    console.see(By.ID, "cancel").click()
    console.see(By.ID, "dialog-no").click()  # kept: nothing happens
    time.sleep(2.5)  # a poll
    assert console.get("/jobs/research/ticking")["status"]["state"] == "Running"
    console.see(By.ID, "cancel").click()
    console.see(By.ID, "dialog-yes").click()
    assert console.text("#run-reason", contains="cancelled") == "All workers ended; some were cancelled"
    assert console.browser.find_element(By.ID, "cancel").get_attribute("disabled") is not None
    assert console.text("#logs-title", contains="ended") == "Logs of w-0 (it ended)"


def test_a_run_is_deleted_from_its_page_once_confirmed_and_listed_as_deleted_after(console: Console) -> None:
    console.submit({"name": "doomed", "groups": [{"name": "w", "command": ["sleep", "600"]}]})
    console.cluster.wait_state("research/doomed", "Running")
    console.login(console.research)
    console.open("#/runs/research/doomed")
    console.see(By.ID, "delete").click()
    assert console.text("#dialog-title") == "Delete research/doomed?"
    console.see(By.ID, "dialog-no").click()
    console.text("#run-reason", contains="running")  # still there
    console.see(By.ID, "delete").click()
    console.see(By.ID, "dialog-yes").click()
    console.until(lambda: console.browser.execute_script("return location.hash") == "#/runs", "back to the runs list")
    _row(console, "research/live")
    assert not console.browser.find_elements(By.CSS_SELECTOR, 'tr[data-run="research/doomed"]')
    console.browser.find_element(By.ID, "include-deleted").click()
    row = _row(console, "research/doomed", contains="Deleted by")
    assert "Deleted by token tok-" in row and "(was Cancelled)" in row
    assert console.cluster.cli("describe", "research/doomed", check=False).returncode == 3


def _gpus(n: int) -> str:
    return f"{n} GPU{'' if n == 1 else 's'}"


def test_the_machines_page_shows_free_room_and_a_machines_page_its_workers_and_history(console: Console) -> None:
    spec = {"name": "holder", "groups": [{"name": "w", "gpus": 1, "cpu": 1, "memory_bytes": GIB,
                                          "command": ["sleep", "600"]}]}  # fmt: skip
    console.submit(spec)
    console.cluster.wait_state("research/holder", "Running")
    console.login(console.admin)
    console.open("#/machines")
    (a0,) = [m for m in console.get("/usage")["machines"] if m["name"] == "a0"]
    assert {"namespace": "research", "run": "holder", "task": "w-0", "gpus": 1, "cpu": 1.0,
            "memory_bytes": GIB} in a0["placed"]  # fmt: skip
    shown = (
        f"{a0['gpus']} GPU{'' if a0['gpus'] == 1 else 's'} · {a0['cpu']:g} CPUs · {a0['memory_bytes'] / GIB:.1f} GiB"
    )
    assert console.text('tr[data-node="a0"] .free') == shown
    (gpu, _) = console.get("/nodes/a0")["inventory"]["gpus"]
    assert f"2 \N{MULTIPLICATION SIGN} {gpu['model']} ({gpu['memory_bytes'] / GIB:.1f} GiB)" in console.text(
        'tr[data-node="a0"]'
    )

    console.browser.find_element(By.LINK_TEXT, "a0").click()
    assert console.text("#machine-free") == shown
    assert "research/holder w-0 1 1 1.0 GiB" in console.text("#placed", contains="holder")
    assert "Ready" in console.text("#machine-history")
    httpx.post(f"{console.url}/jobs/research/holder/cancel", headers={"authorization": f"Bearer {console.research}"})
    freed = _gpus(a0["gpus"] + 1)
    assert console.text("#machine-free", contains=freed).startswith(freed)  # live, without a reload

    console.login(console.other)  # a workspace token sees other workspaces' workers only counted
    console.open("#/machines/a0")
    console.text("#machine-free")
    assert not console.browser.find_elements(By.CSS_SELECTOR, "#placed a[href*=research]")


def test_an_admin_chooses_a_machines_data_location_from_its_page_and_a_workspace_token_sees_no_form(
    console: Console, tmp_path: Path
) -> None:
    source = tmp_path / "corpus"
    source.mkdir()
    (source / "words.txt").write_text("alpha\nbeta\n")
    drive = {"name": "corpus", "machine": "elsewhere", "size_bytes": 1024, "source": str(source)}
    made = httpx.post(f"{console.url}/drives", json=drive, headers={"authorization": f"Bearer {console.admin}"},
                      timeout=60)  # fmt: skip
    assert made.status_code == 200, made.text
    console.submit({"name": "reader", "groups": [{"name": "w", "cpu": 0.5, "restart_policy": "Never",
                    "command": ["sh", "-c", 'cat "$ASTRAEUS_DRIVE_DATA/words.txt"'],
                    "drives": [{"name": "data", "drive": "corpus", "mount_path": "/data"}]}]})  # fmt: skip
    console.login(console.admin)
    console.open("#/runs/research/reader")
    assert console.text("#run-reason", contains="Choose") == "Choose where to keep data on a0"
    assert console.text("#headline") == "A drive needs a place to keep its data"
    console.see(By.ID, "advice-machine").click()  # the advice links to the machine's page
    console.until(lambda: console.browser.execute_script("return location.hash") == "#/machines/a0", "a0's page")
    assert console.text("#data-location").startswith("No data location: workers that need a copy of a drive")
    assert console.text("#drive-copies-none").startswith("No copies of drives here yet")

    path = console.see(By.ID, "data-location-input")
    path.send_keys("/no/such/place")
    console.browser.find_element(By.ID, "data-location-choose").click()
    assert console.text("#dialog-title") == "Keep data on a0 at /no/such/place?"
    console.see(By.ID, "dialog-yes").click()
    refused = console.text("#data-location-error", contains="no such")
    assert refused == "data location /no/such/place: no such directory on machine a0"  # the server's words
    assert console.text("#data-location").startswith("No data location")

    data = tmp_path / "a0-data"
    data.mkdir()
    path.clear()
    path.send_keys(str(data))
    console.browser.find_element(By.ID, "data-location-choose").click()
    console.see(By.ID, "dialog-yes").click()
    shown = console.text("#data-location", contains=str(data))
    assert shown.startswith(f"Copies of drives are kept at {data}, ") and shown.endswith(" free.")
    assert console.browser.find_element(By.ID, "data-location-error").text == ""
    copy = console.text('#drive-copies tr[data-drive="corpus"]', timeout=90)  # the run filled it; shown live
    assert copy.startswith("corpus 11 B ") and copy.endswith(f"{data}/astraeus-drives/corpus")
    assert console.cluster.wait_state("research/reader", "Completed")["status"]["reason"] == "All workers completed"

    console.open("#/drives")
    assert console.text('#drives-table tr[data-drive="corpus"]') == f"corpus any elsewhere 1 KiB {source} —"

    console.login(console.other)
    console.open("#/machines/a0")
    console.text("#data-location", contains=str(data))
    assert not console.browser.find_elements(By.ID, "data-location-form")


def test_no_accessibility_violation_on_any_page_and_a_run_is_cancelled_with_the_keyboard_alone(
    console: Console,
) -> None:
    console.submit({"name": "waits", "groups": [{"name": "w", "gpus": 8, "command": ["sleep", "60"]}]})
    console.browser.get(f"{console.url}/console/")
    console.browser.execute_script("sessionStorage.clear()")
    console.browser.get(f"{console.url}/console/#/runs")
    console.see(By.ID, "token")
    pages = {"login": None, "runs": ("#/runs", "#runs-table"), "waiting run": ("#/runs/research/waits", "#keeps-out"),
             "failing run": ("#/runs/research/flaky", "#workers"), "machines": ("#/machines", 'tr[data-node="a0"]'),
             "machine": ("#/machines/a0", "#data-location-form"), "drives": ("#/drives", "#drives-table"),
             "quotas": ("#/quotas", "#quotas")}  # fmt: skip
    found = {}
    for name, where in pages.items():
        if where is not None:
            if name == "runs":
                console.login(console.admin)
            console.open(where[0])
            console.see(By.CSS_SELECTOR, where[1])
        axe = Axe(console.browser)
        axe.inject()
        violations = axe.run()["violations"]
        found[name] = [f"{v['id']}: {[n['target'] for n in v['nodes']]}" for v in violations]
    assert found == {name: [] for name in pages}

    # The keyboard alone: Tab reaches the cancel button, Enter opens its dialog, focus is in it, Enter confirms.
    console.open("#/runs/research/waits")
    console.text("#run-reason", contains="No machine fits")
    console.browser.find_element(By.TAG_NAME, "body").click()
    for _ in range(40):
        console.browser.switch_to.active_element.send_keys(Keys.TAB)
        if console.browser.switch_to.active_element.get_attribute("id") == "cancel":
            break
    else:
        raise AssertionError("Tab never reached the Cancel run button")
    console.browser.switch_to.active_element.send_keys(Keys.ENTER)
    console.see(By.ID, "dialog-title")
    assert console.browser.switch_to.active_element.get_attribute("id") == "dialog-yes"
    console.browser.switch_to.active_element.send_keys(Keys.ENTER)
    assert console.text("#run-reason", contains="cancelled") == "All workers ended; some were cancelled"


def test_an_admin_removes_a_machine_from_its_page_once_confirmed(console: Console) -> None:
    console.cluster.spawn_agent("b0", "--cpus", "1", "--memory-bytes", "1GiB")
    console.cluster.wait_for(lambda: any(n["name"] == "b0" for n in console.get("/nodes")), "b0 registered")
    console.login(console.admin)
    console.open("#/machines/b0")
    console.see(By.CSS_SELECTOR, "button.remove").click()
    assert console.text("#dialog-title") == "Remove b0?"
    console.see(By.ID, "dialog-reason").send_keys("motherboard replaced")
    console.see(By.ID, "dialog-yes").click()
    assert console.text("#machine-reason", contains="removed") == "Machine removed from the cluster"
    assert "Removed" in console.text("#machine-history", contains="removed")
    assert "An admin removes it: motherboard replaced" in console.text("#machine-history", contains="motherboard")
    assert console.get("/nodes/b0")["state"] == "Removed"


# ---- the way in: `astraeus dev`, as a new user starts it -----------------------------------------------------------


def test_a_new_user_opens_the_console_astraeus_dev_printed_and_sees_why_the_readmes_run_waits(
    tmp_path: Path,
) -> None:
    port, ui, api = free_port(), free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAEUS_")}
    args = ["--port", str(port), "--ui-port", str(ui), "--api", f"127.0.0.1:{api}", "--gpus", "2xL4-24GB",
            "--data-dir", str(tmp_path / "dev")]  # fmt: skip
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen([ASTRAEUS, "dev", *args], stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "local machine(s) ready" not in log.read_text():
            assert dev.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        (link,) = [
            line.removeprefix("Console: ") for line in log.read_text().splitlines() if line.startswith("Console:")
        ]
        assert link.startswith(f"http://127.0.0.1:{api}/console/#sign-in=")
        for example in ("hello.yaml", "too-big.yaml"):
            command = [ASTRAEUS, "submit", str(ROOT / "examples" / example), "--temporal", f"127.0.0.1:{port}"]
            submitted = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
            assert submitted.returncode == 0, submitted.stderr
        with browser(Path(tempfile.mkdtemp(prefix="astraeus-chromium-"))) as driver:
            page = Page(driver)
            driver.get(link)
            page.text('#runs-table tr[data-run="default/hello"]', contains="Completed", timeout=60)
            assert driver.execute_script("return location.hash") == "#/runs"  # the code left the address
            driver.find_element(By.LINK_TEXT, "too-big").click()
            assert page.text("#headline") == "No machine can take it right now"
            assert page.text("#run-reason") == "No machine fits: 1 of 1 machines ready"
            assert page.text("#advice-text").startswith("No machine passes every check")
            assert page.text("#keeps-out tbody tr") == "insufficient gpus: need 64, 2 free and usable 1 local-0"
            temporal = driver.find_element(By.CSS_SELECTOR, "a.temporal").get_attribute("href")
            assert temporal == (f"http://127.0.0.1:{ui}/namespaces/default/workflows?query=WorkflowId%3D%22job%2F"
                                "default%2Ftoo-big%22")  # fmt: skip

            driver.execute_script("sessionStorage.clear()")  # the link again: it signed in once, and says so
            driver.get("about:blank")
            driver.get(link)
            assert page.text("#login-error") == USED_LINK
    finally:
        end_group(dev)
    assert dev.returncode == 0, log.read_text()
