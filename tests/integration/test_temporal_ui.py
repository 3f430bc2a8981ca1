"""The Temporal UI's buttons on a real cluster (the dev server, a control plane, a scheduler and an agent as separate
processes; workers as real local processes), pressed with the `temporal` CLI as the UI would: Terminate leaves the
run's workflow deciding nothing, so the agent finds its worker orphaned and stops it, the machine's history says why,
and `astraeus` shows the run Terminated; Request Cancellation is `astraeus cancel`."""

from __future__ import annotations

import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from activities.agent.runtime.process import ProcessRuntime
from tests.integration.harness import BIN, Cluster, pairs
from workflows.domain.refs import TaskRef

pytestmark = pytest.mark.integration

ORPHAN_CHECK_SECONDS = 1  # with the harness's 1 s stop grace: an orphan is stopped within seconds
BOUND_SECONDS = 30  # how long the test allows, the machine being loaded


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"), orphan_check_seconds=ORPHAN_CHECK_SECONDS)
    try:
        c.start({"n0": ["--cpus", "4"]})
        yield c
    finally:
        c.stop()


def submit_sleeper(cluster: Cluster, tmp_path: Path, name: str) -> TaskRef:
    """A run of one worker that sleeps; returns its attempt once it runs."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: {name}
        groups: [{{name: w, command: [sleep, "600"], cpu: 1}}]
        """)
    )
    cluster.cli("submit", str(path))
    cluster.wait_state(name, "Running")
    return TaskRef(namespace="default", job=name, task_id="w-0", attempt=0)


def temporal(cluster: Cluster, *args: str) -> None:
    """The `temporal` CLI of the venv against the cluster's dev server: what the UI's buttons send."""
    subprocess.run([str(BIN / "temporal"), *args, "--address", cluster.address], check=True, capture_output=True)


def worker_pid(cluster: Cluster, key: TaskRef) -> int:
    return int((cluster.agent_dir("n0") / "tasks" / key.slug / "pid").read_text())


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie has ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_terminated_runs_worker_is_stopped_by_its_machine_which_says_why(cluster: Cluster, tmp_path: Path) -> None:
    key = submit_sleeper(cluster, tmp_path, "sleepy")
    pid = worker_pid(cluster, key)
    assert alive(pid)
    temporal(cluster, "workflow", "terminate", "--workflow-id", "job/default/sleepy", "--reason", "stuck")

    runtime = ProcessRuntime(cluster.agent_dir("n0") / "tasks")

    def stopped() -> bool:  # the worker's process ends first, then its shim, which writes its exit
        return not alive(pid) and not runtime.observe(key).running

    cluster.wait_for(stopped, "the agent to stop the worker", timeout=BOUND_SECONDS)
    why = "Stopped worker w-0 of run default/sleepy: its run is no longer open (terminated)"
    node = cluster.wait_for(
        lambda: next((n for n in cluster.json("nodes") if why in [e["reason"] for e in n["history"]]), None),
        "the machine's history to say why",
    )
    assert pairs(node["history"])[-1] == ("Ready", why)

    terminated = "Its workflow was terminated in Temporal: stuck"
    described = cluster.describe("sleepy")
    assert (described["status"]["state"], described["status"]["reason"]) == ("Terminated", terminated)
    assert pairs(described["history"])[-2:] == [("Running", "1 of 1 workers running"), ("Terminated", terminated)]
    status = cluster.cli("status", "sleepy", check=False)
    assert (status.returncode, status.stdout) == (6, f"Terminated: {terminated}\n")
    summary = ("default", "sleepy", "Terminated")
    assert summary in [(r["namespace"], r["name"], r["state"]) for r in cluster.json("ls")["runs"]]
    assert summary in [
        (r["namespace"], r["name"], r["state"]) for r in cluster.json("ls", "--state", "Terminated")["runs"]
    ]
    assert "sleepy" not in [r["name"] for r in cluster.json("ls", "--state", "Running")["runs"]]


def test_a_cancellation_request_from_the_ui_cancels_the_run_and_stops_its_worker(
    cluster: Cluster, tmp_path: Path
) -> None:
    key = submit_sleeper(cluster, tmp_path, "cancelled")
    pid = worker_pid(cluster, key)
    temporal(cluster, "workflow", "cancel", "--workflow-id", "job/default/cancelled")

    described = cluster.wait_state("cancelled", "Cancelled", "Completed", "Failed", timeout=BOUND_SECONDS)
    assert not alive(pid)
    assert (described["status"]["state"], described["status"]["reason"]) == (
        "Cancelled",
        "All workers ended; some were cancelled",
    )
    assert pairs(described["tasks"][0]["history"])[-2:] == [
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]
    listed = cluster.json("ls", "--state", "Cancelled")["runs"]
    assert ("default", "cancelled", "Cancelled") in [(r["namespace"], r["name"], r["state"]) for r in listed]
