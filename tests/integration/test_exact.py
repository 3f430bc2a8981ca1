"""Reasons exact to the letter (issue 14) on a real cluster (dev server, control plane, scheduler and two agents as
processes), read back through `astraeus describe --json`: quota reasons in exact numbers, a preemption by another
namespace named in parentheses once, the rest of a run a failed worker ends, and a group of total_gpus spread one
worker per machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import Cluster, pairs

pytestmark = pytest.mark.integration

GIB = 2**30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("exact"))
    machine = ["--gpus", "4xL4-24GB", "--cpus", "8", "--memory-bytes", str(32 * GIB)]
    try:
        c.start({"g0": machine, "g1": machine})
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, *groups: dict[str, Any], **fields: Any) -> None:
    spec = {"name": name, "groups": [{"name": "w", "cpu": 0.5, **g} for g in groups], **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def describe(cluster: Cluster, run: str, namespace: str = "default") -> dict[str, Any]:
    return cluster.json("describe", f"{namespace}/{run}")  # type: ignore[no-any-return]


def sleep(seconds: int) -> list[str]:
    return ["sleep", str(seconds)]


def test_a_group_of_total_gpus_puts_one_worker_on_each_machine(cluster: Cluster, tmp_path: Path) -> None:
    # Best fit alone would put both 2-GPU workers on g0: the plan said one per machine.
    submit(cluster, tmp_path, "spread", {"total_gpus": 4, "machines": 2, "command": sleep(1)})
    done = cluster.wait_state("spread", "Completed", "Failed")
    assert done["status"]["reason"] == "All workers completed"
    assert sorted((t["id"], t["node"]) for t in done["tasks"]) == [("w-0", "g0"), ("w-1", "g1")]


def test_quota_reasons_print_memory_in_bytes_and_cpu_exactly(cluster: Cluster, tmp_path: Path) -> None:
    cluster.cli("quota", "set", "qm", "--memory-bytes", str(20 * GIB), "--cpu", "1000")
    submit(cluster, tmp_path, "mem-a", {"memory_bytes": 16 * GIB, "command": sleep(600)}, namespace="qm")
    cluster.wait_for(lambda: describe(cluster, "mem-a", "qm")["status"]["state"] == "Running", "mem-a to run")
    submit(cluster, tmp_path, "mem-b", {"memory_bytes": 8 * GIB, "command": sleep(600)}, namespace="qm")
    why = "memory_bytes 17179869184 in use + 8589934592 asked > 21474836480"
    waits = f"Waits for namespace quota: {why}"
    waiting = cluster.wait_for(
        lambda: (d := describe(cluster, "mem-b", "qm"))["status"]["reason"] == waits and d,
        "mem-b to wait on its quota",
    )
    assert f"Quota reached: {why}" in [e["reason"] for e in waiting["history"]]
    submit(cluster, tmp_path, "cpu-big", {"cpu": 1234.5678, "command": sleep(600)}, namespace="qm")
    never = "cpu 1234.5678 asked > 1000"
    waits = f"Waits for more than the namespace's quota allows at all ({never}): raise the quota or ask for less"
    waiting = cluster.wait_for(
        lambda: (d := describe(cluster, "cpu-big", "qm"))["status"]["reason"] == waits and d,
        "cpu-big to wait on its quota",
    )
    assert f"Quota reached: {never}" in [e["reason"] for e in waiting["history"]]
    for run in ("mem-a", "mem-b", "cpu-big"):
        cluster.cli("cancel", f"qm/{run}")
    cluster.cli("quota", "rm", "qm")
    cluster.wait_for(lambda: describe(cluster, "mem-a", "qm")["status"]["state"] == "Cancelled", "mem-a to end")


def test_a_preemption_by_another_namespace_names_it_in_parentheses_once(cluster: Cluster, tmp_path: Path) -> None:
    on_g0 = {"node_selection": {"names": ["g0"]}}
    submit(cluster, tmp_path, "victim", {"gpus": 4, "command": sleep(30)}, **on_g0)
    cluster.wait_state("victim", "Running")
    submit(cluster, tmp_path, "urgent", {"gpus": 4, "command": sleep(3)}, namespace="research", priority=10, **on_g0)
    urgent = cluster.wait_for(
        lambda: (d := describe(cluster, "urgent", "research"))["status"]["state"] in ("Completed", "Failed") and d,
        "urgent to end",
        timeout=90,
    )
    assert urgent["status"]["reason"] == "All workers completed"
    assert ("Pending", "Preempting 1 lower-priority worker(s) of (a job in another namespace) to start") in pairs(
        urgent["tasks"][0]["history"]
    )
    victim = cluster.describe("victim")
    history = pairs(victim["tasks"][0]["history"])
    assert ("Stopping", "Preempted by higher-priority work (a job in another namespace)") in history
    assert ("Pending", "Preempted by (a job in another namespace); queued again") in history
    waiting = ("Pending", "Preempted by higher-priority work (a job in another namespace); waiting to run again")
    assert waiting in pairs(victim["history"])
    cluster.cli("cancel", "victim")
    cluster.wait_state("victim", "Cancelled", "Completed")


def test_the_rest_of_a_run_a_failed_worker_ends_are_stopped_with_the_specs_reason(
    cluster: Cluster, tmp_path: Path
) -> None:
    bad = {"name": "bad", "command": ["sh", "-c", "sleep 2; exit 3"], "restart_policy": "Never"}
    good = {"name": "good", "command": sleep(600)}
    submit(cluster, tmp_path, "one-fails", bad, good)
    failed = cluster.wait_state("one-fails", "Failed", "Completed", "Cancelled")
    bad_node = next(t for t in failed["tasks"] if t["id"] == "bad-0")["node"]
    assert failed["status"]["reason"] == f"Worker bad-0 failed on {bad_node}: Exited with code 3"
    good_history = pairs(next(t for t in failed["tasks"] if t["id"] == "good-0")["history"])
    assert ("Stopping", "A worker failed, and the run fails on a failure") in good_history
    assert "Run failed" not in [reason for _, reason in good_history]
