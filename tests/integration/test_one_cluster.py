"""Nothing a user does wedges the cluster: the README's tour as written, a second `astraeus dev` on the same ports,
a second agent of a live machine, and an agent that comes back after losing its lease. Every process is started
here and ended by its PID."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from activities.agent.runtime.process import ProcessRuntime
from tests.integration.harness import ASTRAEUS, SETTINGS, Cluster, answers, end_group
from workers.devserver import free_port, port_free
from workflows.domain.refs import TaskRef

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k != "ASTRAEUS_TEMPORAL"}  # the CLI's own default: 127.0.0.1:7233


class Dev:
    """`astraeus dev ...` started in `cwd`, its output in a log; ended by its PID (SIGTERM, as Ctrl-C would)."""

    def __init__(self, cwd: Path, *args: str) -> None:
        self.log = cwd / f"dev-{time.monotonic_ns()}.log"
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [ASTRAEUS, "dev", *args], cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=ENV
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while "local machine(s) ready" not in self.output():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"astraeus dev did not get ready (exit {self.process.poll()}):\n{self.output()}")
            time.sleep(0.25)

    def stop(self) -> None:
        end_group(self.process)


def cli(*args: str, cwd: Path = ROOT, temporal: str | None = None) -> subprocess.CompletedProcess[str]:
    where = ["--temporal", temporal] if temporal else []
    return subprocess.run([ASTRAEUS, *args, *where], cwd=cwd, capture_output=True, text=True, timeout=60, env=ENV)


def wait_for(check: Any, what: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


# ---- the tour --------------------------------------------------------------------------------------------------


def test_the_readme_tour_runs_as_written_with_the_defaults(tmp_path: Path) -> None:
    """`astraeus dev --nodes 2 --gpus 2xL4-24GB` with its default data dir (.astraeus, relative to where it starts)
    and its default ports, then `astraeus submit examples/hello.yaml` from the checkout: hello completes."""
    taken = [port for port in (7233, 8233, 7245) if not port_free(port)]
    if taken:  # the tour is about the defaults: another port would not test it
        pytest.fail(f"ports {taken} are in use on this machine: the tour needs 7233, 8233 and 7245 free")
    dev = Dev(tmp_path, "--nodes", "2", "--gpus", "2xL4-24GB")
    try:
        dev.wait_ready()
        printed = dev.output()
        assert "Temporal frontend: 127.0.0.1:7233\nTemporal UI: http://127.0.0.1:8233\n" in printed
        # The console's address signs in once (tests/integration/test_console.py opens it in a browser).
        (code,) = [line.split("#sign-in=", 1)[1] for line in printed.splitlines() if line.startswith("Console: ")]
        assert "Console: http://127.0.0.1:7245/console/#sign-in=" in printed
        signed_in = httpx.post("http://127.0.0.1:7245/console/sign-in", json={"code": code}, timeout=30)
        token = signed_in.json()["token"]
        assert f"HTTP API: http://127.0.0.1:7245 (admin token: {token})\n" in printed
        assert httpx.post("http://127.0.0.1:7245/console/sign-in", json={"code": code}, timeout=30).status_code == 401
        tour = readme_block("In another terminal (`source .venv/bin/activate` first):")
        assert tour == [
            "astraeus submit examples/hello.yaml",
            "astraeus events hello --follow",
            "astraeus history hello",
            "astraeus ls --state Completed",
        ]
        submitted, events, history, listed = (shell(command) for command in tour)
        assert (submitted.returncode, submitted.stdout) == (0, "submitted default/hello\n"), submitted.stderr
        assert events.returncode == 0, events.stderr  # --follow ends with the run, which Completed
        assert "All workers completed" in events.stdout
        assert history.returncode == 0 and "All workers completed" in history.stdout, history.stderr
        assert listed.returncode == 0 and "hello" in listed.stdout, listed.stderr
        assert cli("status", "hello").stdout == "Completed: All workers completed\n", cli("describe", "hello").stdout
        failing = readme_block("**A failure explains itself.**")
        assert failing == [
            "astraeus submit examples/fail.yaml",
            "astraeus status fail",
            "astraeus describe fail",
            "astraeus logs fail/fail-0",
        ]
        assert shell(failing[0]).returncode == 0
        wait_for(lambda: cli("status", "fail").stdout.split(":")[0] == "Failed", "fail to fail")
        status, described, logs = (shell(command) for command in failing[1:])
        assert (status.returncode, status.stdout) == (
            1,
            "Failed: Worker fail-0 failed on local-0: Exited with code 3\n",
        )
        assert "boom" in described.stdout, described.stderr
        assert "boom" in logs.stdout, logs.stderr
        example = readme_block("The Python client offers the same verbs:", fence="```python\n", whole=True)
        ran = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "python"), "-c", "\n".join(example)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env=ENV,
        )
        assert (ran.returncode, ran.stdout) == (0, "Completed: All workers completed\n"), ran.stderr
        deleting = readme_block("## Deleting a run")
        assert deleting == ["astraeus delete hello", "astraeus ls --include-deleted --state Deleted"]
        deleted, tombstones = (shell(command) for command in deleting)
        assert (deleted.returncode, deleted.stdout) == (0, "deleted default/hello (it was Completed)\n"), deleted.stderr
        assert tombstones.returncode == 0 and "hello" in tombstones.stdout, tombstones.stderr
        assert cli("status", "hello").returncode == 3  # no run named hello any more
        assert (tmp_path / ".astraeus" / "temporal.db").is_file()
    finally:
        dev.stop()
    assert dev.process.returncode == 0, dev.output()


def readme_block(after: str, fence: str = "```sh\n", whole: bool = False) -> list[str]:
    """The commands of the README's first `sh` block after the line `after`, without their comments (`whole`:
    the block's lines as they are, of the first block opened by `fence`)."""
    text = (ROOT / "README.md").read_text()
    block = text.split(after, 1)[1].split(fence, 1)[1].split("```", 1)[0]
    if whole:
        return block.splitlines()
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def shell(command: str) -> subprocess.CompletedProcess[str]:
    """`command` as a user types it in the checkout, with the virtual environment active."""
    env = {**ENV, "PATH": f"{ROOT / '.venv' / 'bin'}:{ENV.get('PATH', '')}"}
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env
    )


def test_the_readmes_scripting_commands_run_as_written_with_the_defaults(tmp_path: Path) -> None:
    """The README's "In scripts and CI" commands, on a cluster of their own with the defaults, exit as it says."""
    taken = [port for port in (7233, 8233, 7245) if not port_free(port)]
    if taken:
        pytest.fail(f"ports {taken} are in use on this machine: the README's commands need 7233, 8233 and 7245 free")
    commands = readme_block("`status`, `wait`, `events --follow` and `submit --wait`/`--follow` exit by the run's")
    assert commands == [
        "astraeus submit examples/fail.yaml --wait",
        "astraeus submit examples/hello.yaml --follow",
        "astraeus wait hello --for Running --timeout 60",
        "astraeus status default/hello",
        "astraeus logs hello/worker-0 --follow",
    ]
    dev = Dev(tmp_path, "--nodes", "2", "--gpus", "2xL4-24GB")
    try:
        dev.wait_ready()
        results = [shell(command) for command in commands]
        assert [r.returncode for r in results] == [1, 0, 0, 0, 0]
        assert results[0].stdout.endswith("Failed: Worker fail-0 failed on local-0: Exited with code 3\n")
        assert results[3].stdout == "Completed: All workers completed\n"
        assert results[4].stdout.strip()  # the worker's greeting
        # The README's closed pipe: nothing on stderr. The exit is 141 when the reader went away before all was
        # written; hello's short history may all fit in the pipe first (then 0).
        closed = shell("astraeus history hello | head -1; exit ${PIPESTATUS[0]}")
        assert (closed.stderr, len(closed.stdout.splitlines())) == ("", 1)
        assert closed.returncode in (0, 141)
    finally:
        dev.stop()


def test_the_readmes_http_api_walk_through_runs_as_written_with_the_defaults(tmp_path: Path) -> None:
    """The README's "The HTTP API" commands with the defaults: `astraeus dev` serves the API on 7245, and the block
    runs in one shell, as a person types it."""
    taken = [port for port in (7233, 8233, 7245) if not port_free(port)]
    if taken:
        pytest.fail(f"ports {taken} are in use on this machine: the README's commands need 7233, 8233 and 7245 free")
    block = readme_block("## The HTTP API")
    assert block[0] == "API=http://127.0.0.1:7245"
    dev = Dev(tmp_path, "--nodes", "2", "--gpus", "2xL4-24GB")
    try:
        dev.wait_ready()
        assert answers("http://127.0.0.1:7245/healthz")
        ran = shell("\n".join(["set -e", *block]))
        assert ran.returncode == 0, ran.stdout + ran.stderr
        assert '"run":"team-a/hello"' in ran.stdout.replace(" ", "")
        assert "event: end" in ran.stdout
        gone = cli("describe", "team-a/hello")  # deleted, as the walk-through ends
        assert (gone.returncode, gone.stderr) == (3, "astraeus: no run named hello in namespace team-a\n")
        listed = shell("astraeus ls --include-deleted -n team-a --json")
        (tombstone,) = [r for r in json.loads(listed.stdout)["runs"] if r["name"] == "hello"]
        assert (tombstone["state"], tombstone["last_state"]) == ("Deleted", "Cancelled")
    finally:
        dev.stop()


# ---- a second `astraeus dev` -----------------------------------------------------------------------------------


@pytest.fixture
def first_dev(tmp_path: Path) -> Iterator[tuple[Dev, int, int, int]]:
    settings = tmp_path / "settings.yaml"
    settings.write_text(yaml.safe_dump(SETTINGS))
    port, ui, api = free_port(), free_port(), free_port()
    (tmp_path / "first").mkdir()
    dev = Dev(tmp_path / "first", "--port", str(port), "--ui-port", str(ui), "--api", f"127.0.0.1:{api}",
              "--gpus", "2xL4-24GB", "--settings", str(settings))  # fmt: skip
    try:
        dev.wait_ready()
        yield dev, port, ui, api
    finally:
        dev.stop()


def test_a_second_dev_on_the_same_ports_refuses_to_start_and_leaves_the_first_cluster_alone(
    tmp_path: Path, first_dev: tuple[Dev, int, int, int]
) -> None:
    _, port, ui, api = first_dev
    temporal = f"127.0.0.1:{port}"
    before = cli("nodes", "--json", temporal=temporal).stdout
    (tmp_path / "second").mkdir()
    second = subprocess.run(
        [ASTRAEUS, "dev", "--port", str(port), "--ui-port", str(ui), "--api", f"127.0.0.1:{api}"],
        cwd=tmp_path / "second",
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert (second.returncode, second.stdout) == (2, "")
    assert second.stderr.endswith(
        f"astraeus: dev: cannot start: port {port} (Temporal frontend), {ui} (Temporal UI) and {api} (HTTP API and "
        "console) on 127.0.0.1 are in use, by another `astraeus dev`, `astraeus api` or Temporal server perhaps: stop "
        "it, or choose other ports with --port, --ui-port and --api (or --no-api)\n"
    )
    assert not (tmp_path / "second" / ".astraeus").exists()  # nothing was started there
    time.sleep(SETTINGS["node_lease_ttl_seconds"] + 2)  # long enough for a lost lease to show
    assert cli("nodes", "--json", temporal=temporal).stdout == before


# ---- a second agent, and an agent that comes back ------------------------------------------------------------------


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        c.start({"x": ["--cpus", "4"]})
        yield c
    finally:
        c.stop()


def node(cluster: Cluster, name: str) -> dict[str, Any]:
    return next(n for n in cluster.json("nodes") if n["name"] == name)  # type: ignore[no-any-return]


def test_a_second_agent_of_a_live_machine_is_refused_naming_the_agent_that_holds_it(cluster: Cluster) -> None:
    before = node(cluster, "x")
    holder = before["holder"]
    pid = cluster.processes["x"].pid
    assert holder.split(":")[1] == str(pid)
    second = subprocess.run(
        [ASTRAEUS, "agent", "--name", "x", "--data-dir", str(cluster.root / "second"), "--temporal", cluster.address],
        capture_output=True,
        text=True,
        timeout=60,
        env=ENV,
    )
    assert (second.returncode, second.stderr.splitlines()[-1]) == (
        2,
        f"astraeus: machine x is held by agent {holder}, whose lease is live: stop that agent first, or give this "
        "one another --name",
    )
    assert node(cluster, "x") == before


def test_a_killed_agent_started_again_takes_its_machine_over_at_once(cluster: Cluster) -> None:
    old = node(cluster, "x")["holder"]
    cluster.kill("x")
    cluster.spawn_agent("x", "--cpus", "4")
    view = cluster.wait_for(lambda: (n := node(cluster, "x"))["holder"] != old and n, "the new agent to hold x")
    assert (view["state"], view["holder"].split(":")[1]) == ("Ready", str(cluster.processes["x"].pid))


def test_an_agent_back_after_losing_its_lease_stops_its_workers_and_exits(cluster: Cluster, tmp_path: Path) -> None:
    run = tmp_path / "sleepy.yaml"
    run.write_text("name: sleepy\ngroups: [{name: w, command: [sleep, '600'], cpu: 1, restart_policy: Never}]\n")
    cluster.cli("submit", str(run))
    cluster.wait_state("sleepy", "Running")
    old = cluster.processes["x"]
    old.send_signal(signal.SIGSTOP)  # away for longer than its lease
    try:
        cluster.wait_for(lambda: node(cluster, "x")["state"] == "Down", "x to go Down", timeout=60)
        again = tmp_path / "x-again"
        cluster.agent_dirs.append(again)
        cluster.spawn("x-again", "agent", "--name", "x", "--cpus", "4", "--data-dir", str(again))
        new = cluster.wait_for(lambda: (n := node(cluster, "x"))["state"] == "Ready" and n, "x registered again")
    finally:
        old.send_signal(signal.SIGCONT)
    assert old.wait(timeout=60) == 2
    log = (cluster.root / "x.log").read_text()
    assert (
        f"astraeus: agent {socket.gethostname()}:{old.pid}:" in log
        and f" of machine x: its lease expired; the machine is now held by agent {new['holder']}. It stopped its 1 "
        "running worker(s) and exits rather than run beside another agent"
        in log
    ), log
    runtime = ProcessRuntime(cluster.agent_dir("x") / "tasks")
    assert not runtime.observe(TaskRef(namespace="default", job="sleepy", task_id="w-0", attempt=0)).running
    assert node(cluster, "x")["holder"] == new["holder"]


def test_an_agent_back_after_its_lease_expired_registers_again_and_stops_the_worker_its_run_lost(
    cluster: Cluster, tmp_path: Path
) -> None:
    # Issue 11, finding 6: a live agent whose lease expired (paused, or cut off from Temporal) used to leave its
    # machine Down for good. Nobody else holds the machine: it registers again on its own, without a restart. Its
    # run lost the worker with the machine and runs a new attempt there; the stale one is stopped (finding 5).
    run = tmp_path / "sleepy.yaml"
    run.write_text("name: sleepy\ngroups: [{name: w, command: [sleep, '600'], cpu: 1}]\n")
    cluster.cli("submit", str(run))
    cluster.wait_state("sleepy", "Running")
    holder = node(cluster, "x")["holder"]
    agent = cluster.processes["x"]
    agent.send_signal(signal.SIGSTOP)  # away for longer than its lease
    try:
        cluster.wait_for(lambda: node(cluster, "x")["state"] == "Down", "x to go Down", timeout=60)
    finally:
        agent.send_signal(signal.SIGCONT)
    cluster.wait_for(lambda: node(cluster, "x")["state"] == "Ready", "x to register again", timeout=60)
    task = cluster.wait_for(
        lambda: (
            (t := cluster.describe("sleepy")["tasks"][0])["attempt"] == 1 and t["status"]["state"] == "Running" and t
        ),
        "the run's new attempt to run on x",
        timeout=60,
    )
    runtime = ProcessRuntime(cluster.agent_dir("x") / "tasks")
    lost = TaskRef(namespace="default", job="sleepy", task_id="w-0", attempt=0)
    cluster.wait_for(lambda: not runtime.observe(lost).running, "the lost attempt to be stopped", timeout=30)
    assert (task["node"], agent.poll(), node(cluster, "x")["holder"]) == ("x", None, holder)
    assert [key.attempt for key in runtime.running()] == [1]
    reasons = [entry["reason"] for entry in node(cluster, "x")["history"]]
    assert "Stopped worker w-0 (attempt 0) of run default/sleepy: its run no longer has it here" in reasons


@pytest.fixture
def patient_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """One machine whose workers wait a minute before they run again."""
    c = Cluster(tmp_path, backoff_base_seconds=60, backoff_cap_seconds=120)
    try:
        c.start({"x": ["--cpus", "4"]})
        yield c
    finally:
        c.stop()


def test_a_worker_that_exited_0_while_its_machine_was_lost_completes_when_the_machine_comes_back(
    patient_cluster: Cluster, tmp_path: Path
) -> None:
    # Issue 11, finding 8: its run lost the worker with the machine and would run it again after its back-off; the
    # agent that comes back reads its exit 0 back from the machine and tells the run, so it is not run again.
    cluster = patient_cluster
    run = tmp_path / "short.yaml"
    run.write_text("name: short\ngroups: [{name: w, command: [sleep, '5'], cpu: 1}]\n")
    cluster.cli("submit", str(run))
    cluster.wait_state("short", "Running")
    agent = cluster.processes["x"]
    agent.send_signal(signal.SIGSTOP)  # away for longer than its lease, while its worker ends
    runtime = ProcessRuntime(cluster.agent_dir("x") / "tasks")
    key = TaskRef(namespace="default", job="short", task_id="w-0", attempt=0)
    try:
        cluster.wait_for(lambda: node(cluster, "x")["state"] == "Down", "x to go Down", timeout=60)
        cluster.wait_for(lambda: runtime.observe(key).exit_code == 0, "the worker to exit 0", timeout=30)
        # its run hears of the loss from the scheduler, a moment after the machine's workflow decided it
        cluster.wait_for(lambda: cluster.describe("short")["tasks"][0]["status"]["state"] == "Down", "w-0 Down")
    finally:
        agent.send_signal(signal.SIGCONT)
    described = cluster.wait_state("short", "Completed", timeout=45)
    task = described["tasks"][0]
    assert (task["attempt"], described["status"]["reason"], agent.poll()) == (0, "All workers completed", None)
    assert [(e["state"], e["reason"]) for e in task["history"]][-2:] == [
        ("Down", "Machine lost: its lease expired"),
        ("Completed", "Exited with code 0"),
    ]
