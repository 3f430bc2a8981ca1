"""Backfill end to end: the head of the queue holds its machine until the time-limited work there ends; a run whose
time limit ends before then starts now, one without a limit queues behind the head. Read through `describe`."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import Cluster

GIB = 2**30


pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("backfill"))
    try:
        c.start({"g0": ["--gpus", "4xL4-24GB", "--cpus", "8", "--memory-bytes", str(16 * GIB)]})
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, gpus: int, sleep: int, limit: int | None = None) -> None:
    group: dict[str, Any] = {"name": "w", "command": ["sleep", str(sleep)], "gpus": gpus, "cpu": 0.5}
    if limit is not None:
        group["time_limit_seconds"] = limit
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "groups": [group]}))
    cluster.cli("submit", str(path))


def test_a_run_that_ends_before_the_head_starts_runs_now_and_the_head_keeps_its_time(
    cluster: Cluster, tmp_path: Path
) -> None:
    submit(cluster, tmp_path, "runner", gpus=3, sleep=600, limit=3600)
    cluster.wait_state("runner", "Running")
    submit(cluster, tmp_path, "head", gpus=4, sleep=1)
    head = cluster.wait_for(
        lambda: (d := cluster.describe("head"))["status"]["code"] == "NextToRunStartsBy" and d, "head to hold room"
    )
    match = re.fullmatch(
        r"Next to run \(priority 0\): starts by (\d{4}-\d\d-\d\d \d\d:\d\d) UTC as running work ends",
        head["status"]["reason"],
    )
    assert match, head["status"]["reason"]
    starts = match.group(1)

    submit(cluster, tmp_path, "quick", gpus=1, sleep=1, limit=600)  # ends long before the head starts
    assert cluster.wait_state("quick", "Completed")["status"]["reason"] == "All workers completed"
    submit(cluster, tmp_path, "slow", gpus=1, sleep=1)  # no time limit: it would delay the head
    slow = cluster.wait_for(
        lambda: (d := cluster.describe("slow"))["status"]["code"] == "QueuedBehindStartsBy" and d, "slow to queue"
    )
    assert slow["status"]["reason"] == f"Queued behind head, which starts by {starts} UTC"
    assert cluster.describe("head")["status"]["reason"] == head["status"]["reason"]  # the head was not delayed

    cluster.cli("cancel", "runner")
    assert cluster.wait_state("head", "Completed")["status"]["reason"] == "All workers completed"
    assert cluster.wait_state("slow", "Completed")["status"]["reason"] == "All workers completed"
