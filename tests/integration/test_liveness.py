"""Liveness with real agents: a killed agent's workers go Stale, then Down, then restart elsewhere; a paused agent
that resumes within the TTL brings its workers back. Reasons read through `astraeus history`."""

from __future__ import annotations

import re
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Cluster, pairs

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    # A missed heartbeat is Stale after 1.5 s; a machine unheard for 6 s is Down; the worker TTL outlasts both.
    c = Cluster(tmp_path, stale_grace_seconds=1.5, heartbeat_ttl_seconds=60, node_lease_ttl_seconds=6)
    try:
        c.start({"a": ["--cpus", "2"], "b": ["--cpus", "2"]})
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, cpu: float) -> None:
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        textwrap.dedent(f"""\
        name: {name}
        groups: [{{name: w, command: [sleep, "600"], cpu: {cpu}}}]
        """)
    )
    cluster.cli("submit", str(path))


def worker(cluster: Cluster, run: str) -> dict:  # type: ignore[type-arg]
    return cluster.describe(run)["tasks"][0]  # type: ignore[no-any-return]


def test_a_killed_agent_makes_its_workers_stale_then_down_then_restarted_elsewhere(
    cluster: Cluster, tmp_path: Path
) -> None:
    submit(cluster, tmp_path, "survivor", cpu=1.5)
    cluster.wait_state("survivor", "Running")
    lost = worker(cluster, "survivor")["node"]
    cluster.kill(lost, signal.SIGKILL)
    cluster.wait_for(lambda: worker(cluster, "survivor")["attempt"] == 1, "the worker to restart", timeout=90)
    cluster.wait_for(lambda: worker(cluster, "survivor")["status"]["state"] == "Running", "it to run again")
    task = worker(cluster, "survivor")
    assert task["node"] != lost
    history = pairs(task["history"])
    # Down, then it waits for the lost machine's fence (its copy there surely stopped) rather than its back-off
    fence = history[7]
    assert re.fullmatch(
        rf"Restarts at \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC, once its copy on {lost} has surely stopped", fence[1]
    )
    assert history[4:10] == [
        ("Running", "Container running"),
        ("Stale", "Heartbeat lease expired"),
        ("Down", "Machine lost: its lease expired"),
        ("Down", fence[1]),
        ("Pending", "Restarted by policy (restart 1/10)"),
        ("Pending", f"Placed on {task['node']}"),
    ]
    text = cluster.cli("history", "survivor").stdout
    assert "Stale        Heartbeat lease expired" in text
    assert "Down         Machine lost: its lease expired" in text
    nodes = {n["name"]: n["state"] for n in cluster.json("nodes")}
    assert nodes[lost] == "Down"


def test_a_paused_agent_that_resumes_within_the_ttl_brings_its_workers_back(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "paused", cpu=1)
    cluster.wait_state("paused", "Running")
    node = worker(cluster, "paused")["node"]
    agent = cluster.processes[node]
    agent.send_signal(signal.SIGSTOP)
    try:
        cluster.wait_for(lambda: worker(cluster, "paused")["status"]["state"] == "Stale", "Stale", timeout=30)
    finally:
        agent.send_signal(signal.SIGCONT)
    cluster.wait_for(
        lambda: pairs(worker(cluster, "paused")["history"])[-1] == ("Running", "Heartbeat received"),
        "the heartbeat to come back",
    )
    assert pairs(worker(cluster, "paused")["history"])[4:7] == [
        ("Running", "Container running"),
        ("Stale", "Heartbeat lease expired"),
        ("Running", "Heartbeat received"),
    ]
    assert "Running      Heartbeat received" in cluster.cli("history", "paused").stdout
    assert {n["name"]: n["state"] for n in cluster.json("nodes")}[node] == "Ready"
