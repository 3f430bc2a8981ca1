"""One run end to end on a real cluster: the dev server, a control plane, a scheduler and two agents as separate
processes, workers as real local processes, every verb through the `astraeus` CLI."""

from __future__ import annotations

import signal
import textwrap
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest

from tests.integration.harness import Cluster, pairs

pytestmark = pytest.mark.integration

GIB = 2**30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start(
            {
                "n0": ["--gpus", "4xL4-24GB", "--cpus", "8", "--memory-bytes", str(16 * GIB)],
                "n1": ["--cpus", "4", "--memory-bytes", str(8 * GIB)],
            }
        )
        yield c
    finally:
        c.stop()


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_hello_runs_two_workers_to_completion(cluster: Cluster) -> None:
    cluster.cli("submit", "examples/hello.yaml")
    described = cluster.wait_state("hello", "Completed", "Failed")
    assert (described["status"]["state"], described["status"]["reason"]) == ("Completed", "All workers completed")
    history = pairs(described["history"])
    assert history[:3] == [
        ("Pending", "Run created"),
        ("Pending", "Waiting for workers to be created"),
        ("Pending", "Waiting for workers to start"),
    ]
    assert ("Running", "2 of 2 workers running") in history
    for task in described["tasks"]:
        # Pending until its machine picks it up (its placement shown meanwhile), then Preparing with its machine's
        # reason; each entry at the time it happened, in order.
        assert pairs(task["history"]) == [
            ("Pending", "Waiting for workers to start"),
            ("Pending", f"Placed on {task['node']}"),
            ("Preparing", f"Picked up by {task['node']}"),
            ("Starting", "Container started"),
            ("Running", "Container running"),
            ("Completed", "Exited with code 0"),
        ]
        times = [datetime.fromisoformat(e["at"]) for e in task["history"]]
        assert times == sorted(times)
    assert set(described) == {"id", "namespace", "name", "spec", "status", "history", "tasks", "placement"}
    assert set(described["status"]) == {"state", "reason", "code", "created_at", "started_at", "finished_at"}
    assert set(described["tasks"][0]) >= {"id", "group", "node", "restarts", "restart_at", "status", "history"}
    listed = cluster.json("ls", "--state", "Completed")["runs"]
    hello = next(r for r in listed if r["name"] == "hello")
    assert (hello["namespace"], hello["state"], hello["workers"], hello["gpus"]) == ("default", "Completed", 2, 0)


def test_a_failing_worker_fails_its_run_with_its_log(cluster: Cluster) -> None:
    cluster.cli("submit", "examples/fail.yaml")
    described = cluster.wait_state("fail", "Failed", "Completed")
    task = described["tasks"][0]
    assert described["status"]["reason"] == f"Worker fail-0 failed on {task['node']}: Exited with code 3"
    assert task["last_failure"]["exit_code"] == 3
    assert task["last_failure"]["reason"] == "Exited with code 3"
    assert "boom" in task["last_failure"]["log_tail"]
    human = cluster.cli("describe", "fail").stdout
    assert "| boom" in human
    late = cluster.cli("stop", "fail/fail-0", check=False)
    assert (late.returncode, late.stderr.strip()) == (2, "astraeus: run default/fail already ended: Failed")
    unknown = cluster.cli("cancel", "nope", check=False)
    assert (unknown.returncode, unknown.stderr.strip()) == (3, "astraeus: no run named nope in namespace default")


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (["sh", "-c", "exit 126"], 126),
        (["/no/such/program"], 127),
        (["sh", "-c", "kill -KILL $$"], 137),
        (["sh", "-c", "kill -TERM $$"], 143),
    ],
    ids=["126 not executable", "127 not found", "137 SIGKILL", "143 SIGTERM outside a stop"],
)
def test_exit_codes_fail_with_their_code(cluster: Cluster, tmp_path: Path, command: list[str], code: int) -> None:
    name = f"exit-{code}"
    spec = {"name": name, "groups": [{"name": "w", "command": command, "restart_policy": "Never"}]}
    import yaml

    cluster.cli("submit", write(tmp_path, yaml.safe_dump(spec)))
    described = cluster.wait_state(name, "Failed", "Completed")
    node = described["tasks"][0]["node"]
    assert described["status"]["reason"] == f"Worker w-0 failed on {node}: Exited with code {code}"


def test_a_run_too_big_for_any_machine_says_why_machine_by_machine(cluster: Cluster) -> None:
    cluster.cli("submit", "examples/too-big.yaml")
    described = cluster.wait_for(
        lambda: (d := cluster.describe("too-big"))["placement"]["nodes"] and d, "too-big to explain its wait"
    )
    assert described["status"]["state"] == "Pending"
    assert described["status"]["reason"] == "No machine fits: 2 of 2 machines ready"
    assert described["placement"]["nodes"] == [
        {"name": "n0", "reasons": ["insufficient gpus: need 64, 4 free and usable"]},
        {"name": "n1", "reasons": ["insufficient gpus: need 64, 0 free and usable"]},
    ]
    human = cluster.cli("describe", "too-big").stdout
    assert "n0: insufficient gpus: need 64, 4 free and usable" in human
    cluster.cli("cancel", "too-big")
    described = cluster.wait_state("too-big", "Cancelled")
    assert pairs(described["tasks"][0]["history"])[-1] == ("Cancelled", "Run cancelled")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("name: bad\nfoo: 1\ngroups: [{name: w, command: [x]}]\n", "foo: unknown field"),
        (
            "name: bad\ngroups: [{name: w, command: [x], gpus: -1}]\n",
            "groups.0.gpus: Input should be greater than or equal to 0",
        ),
        ("name: bad\ngroups: [{name: w}]\n", "groups.0.command: Field required"),
    ],
    ids=["unknown field", "negative gpus", "no command"],
)
def test_an_invalid_spec_is_refused_and_nothing_starts(
    cluster: Cluster, tmp_path: Path, spec: str, message: str
) -> None:
    result = cluster.cli("submit", write(tmp_path, spec), check=False)
    assert result.returncode == 2
    assert message in result.stderr.splitlines()
    gone = cluster.cli("status", "bad", check=False)
    assert gone.returncode == 3
    assert gone.stderr.strip() == "astraeus: no run named bad in namespace default"


def test_cancel_and_stop_reach_real_processes(cluster: Cluster, tmp_path: Path) -> None:
    spec = "name: sleepy\ngroups: [{name: w, replicas: 2, command: [sleep, '600'], cpu: 0.5}]\n"
    cluster.cli("submit", write(tmp_path, spec))
    cluster.wait_for(lambda: cluster.describe("sleepy")["status"]["reason"] == "2 of 2 workers running", "running")
    cluster.cli("stop", "sleepy/w-0", "--reason", "Making room")
    described = cluster.wait_for(
        lambda: (d := cluster.describe("sleepy"))["tasks"][0]["status"]["state"] == "Cancelled" and d, "w-0 stopped"
    )
    assert pairs(described["tasks"][0]["history"])[-2:] == [
        ("Stopping", "Making room"),
        ("Cancelled", "Stopped on request"),
    ]
    again = cluster.cli("stop", "sleepy/w-0", check=False)
    assert again.returncode == 2
    assert again.stderr.strip() == "astraeus: worker w-0 of run sleepy already ended: Cancelled"
    cluster.cli("cancel", "sleepy")
    described = cluster.wait_state("sleepy", "Cancelled")
    assert described["status"]["reason"] == "All workers ended; some were cancelled"
    assert pairs(described["tasks"][1]["history"])[-2:] == [
        ("Stopping", "Run cancelled"),
        ("Cancelled", "Stopped on request"),
    ]


def test_runs_survive_a_killed_control_plane(cluster: Cluster, tmp_path: Path) -> None:
    spec = "name: durable-{i}\ngroups: [{{name: w, command: [sleep, '15'], cpu: 0.5}}]\n"
    for i in range(3):
        (tmp_path / f"d{i}.yaml").write_text(spec.format(i=i))
        cluster.cli("submit", str(tmp_path / f"d{i}.yaml"))
    for i in range(3):
        cluster.wait_state(f"durable-{i}", "Running")
    cluster.kill("control", signal.SIGKILL)
    cluster.spawn("control", "control")
    for i in range(3):
        described = cluster.wait_state(f"durable-{i}", "Completed", "Failed")
        assert described["status"]["reason"] == "All workers completed"
        starts = [e for e in described["tasks"][0]["history"] if e["state"] == "Starting"]
        assert len(starts) == 1  # started once, never twice


def test_a_restarted_scheduler_rebuilds_its_view_and_places_what_waits(cluster: Cluster, tmp_path: Path) -> None:
    hog = "name: hog\ngroups: [{name: w, command: [sleep, '600'], gpus: 4}]\n"
    waiter = "name: waiter\ngroups: [{name: w, command: [sleep, '1'], gpus: 2}]\n"
    cluster.cli("submit", write(tmp_path, hog))
    cluster.wait_state("hog", "Running")
    (tmp_path / "waiter.yaml").write_text(waiter)
    cluster.cli("submit", str(tmp_path / "waiter.yaml"))
    cluster.wait_for(lambda: cluster.describe("waiter")["placement"]["nodes"], "waiter to wait")
    cluster.kill("scheduler", signal.SIGKILL)
    cluster.spawn("scheduler", "scheduler")
    cluster.cli("cancel", "hog")
    described = cluster.wait_state("waiter", "Completed", "Failed")
    assert described["status"]["reason"] == "All workers completed"
    assert described["tasks"][0]["node"] == "n0"
    nodes = {n["name"]: n for n in cluster.json("nodes")}
    assert nodes["n0"]["state"] == "Ready"
    assert len(nodes["n0"]["inventory"]["gpus"]) == 4
