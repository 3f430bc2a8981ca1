"""Preemption end to end: a higher-priority run stops lower-priority work to start; the victim is queued again
without spending its restart budget, and runs again once there is room. Read through `astraeus describe --json`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.harness import Cluster, pairs
from workflows.domain.reasons import R

pytestmark = pytest.mark.integration

GIB = 2**30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("preemption"))
    try:
        c.start({"g0": ["--gpus", "4xL4-24GB", "--cpus", "8", "--memory-bytes", str(16 * GIB)]})
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, priority: int, sleep: int) -> None:
    spec = {"name": name, "priority": priority, "groups": [{"name": "w", "command": ["sleep", str(sleep)], "gpus": 4}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def test_higher_priority_work_preempts_and_the_victim_runs_again_uncharged(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "victim", priority=0, sleep=20)
    cluster.wait_state("victim", "Running")
    submit(cluster, tmp_path, "urgent", priority=10, sleep=1)
    urgent = cluster.wait_state("urgent", "Completed", "Failed", timeout=90)
    assert urgent["status"]["reason"] == "All workers completed"
    preempting = ("Pending", "Preempting 1 lower-priority worker(s) of victim to start")
    assert preempting in pairs(urgent["tasks"][0]["history"])

    victim = cluster.wait_state("victim", "Completed", "Failed", timeout=120)
    assert victim["status"]["reason"] == "All workers completed"
    task = victim["tasks"][0]
    history = pairs(task["history"])
    assert ("Stopping", "Preempted by higher-priority work (urgent)") in history
    assert ("Pending", "Preempted by urgent; queued again") in history
    # Ran, was preempted, ran again. A heartbeat late on a loaded machine adds ("Running", "Heartbeat received")
    # after a Stale, which is no start.
    starts = [pair for pair in history if pair[0] == "Running" and pair[1] != R.HeartbeatReceived.fill().text]
    assert len(starts) == 2, history
    assert task["restarts"] == 0  # a preempted worker is not charged
    assert urgent["status"]["started_at"] < victim["status"]["finished_at"]
