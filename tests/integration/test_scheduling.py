"""The scheduler end to end on a real cluster (dev server, control plane, scheduler and agents as processes),
read back through `astraeus describe --json`: priority, quotas, cordoned machines, and a scheduler killed with
SIGKILL mid-queue that comes back and decides the same."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import Cluster

pytestmark = pytest.mark.integration

GIB = 2**30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("scheduling"))
    try:
        c.start(
            {
                "g0": ["--gpus", "4xL4-24GB", "--cpus", "8", "--memory-bytes", str(16 * GIB), "--rack", "r1"],
                "c0": ["--cpus", "4", "--memory-bytes", str(8 * GIB), "--pool", "cpu-only"],
            }
        )
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, **fields: Any) -> None:
    group = {"name": "w", "command": ["sleep", str(fields.pop("sleep", 600))], "cpu": 0.5}
    group.update(fields.pop("group", {}))
    spec = {"name": name, "groups": [group], **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def reason(cluster: Cluster, run: str) -> str:
    return str(cluster.describe(run)["status"]["reason"])


def wait_reason(cluster: Cluster, run: str, expected: str, timeout: float = 60) -> dict[str, Any]:
    return cluster.wait_for(  # type: ignore[no-any-return]
        lambda: (d := cluster.describe(run))["status"]["reason"] == expected and d,
        f"{run} to say {expected!r} (it says {reason(cluster, run)!r})",
        timeout,
    )


def reasons_of(described: dict[str, Any]) -> list[str]:
    return [e["reason"] for e in described["history"]]


def test_higher_priority_goes_first_and_the_rest_say_why(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "hog", priority=5, group={"gpus": 4})
    cluster.wait_state("hog", "Running")
    submit(cluster, tmp_path, "low", priority=1, sleep=1, group={"gpus": 4})
    wait_reason(cluster, "low", "Next to run (priority 1): waits for running work to end")
    submit(cluster, tmp_path, "high", priority=3, sleep=1, group={"gpus": 4})
    wait_reason(cluster, "high", "Next to run (priority 3): waits for running work to end")
    described = wait_reason(cluster, "low", "Queued behind higher-priority work (high)")
    assert described["placement"]["nodes"] == [
        {"name": "c0", "reasons": ["insufficient gpus: need 4, 0 free and usable"]},
        {"name": "g0", "reasons": ["insufficient gpus: need 4, 0 free and usable"]},
    ]
    cluster.cli("cancel", "hog")
    high = cluster.wait_state("high", "Completed", "Failed")
    low = cluster.wait_state("low", "Completed", "Failed")
    assert high["status"]["reason"] == low["status"]["reason"] == "All workers completed"
    assert high["status"]["started_at"] < low["status"]["started_at"]
    assert "Queued behind higher-priority work (high)" in reasons_of(low)


def test_a_namespace_quota_holds_its_work_and_no_one_else(cluster: Cluster, tmp_path: Path) -> None:
    cluster.cli("quota", "set", "qa", "--gpus", "2")
    assert cluster.json("quota", "ls") == [
        {"namespace": "qa", "gpus": 2, "cpu": None, "memory_bytes": None, "pools": []}
    ]
    submit(cluster, tmp_path, "pair", namespace="qa", group={"gpus": 2, "replicas": 2})
    described = cluster.wait_for(
        lambda: (d := cluster.json("describe", "qa/pair"))["status"]["state"] == "Running" and d, "pair to run"
    )
    waiting = [t for t in described["tasks"] if t["status"]["state"] == "Pending"]
    assert [t["status"]["reason"] for t in waiting] == ["Waits for namespace quota: gpus 2 in use + 2 asked > 2"]
    entries = [e for e in described["history"] if e["code"] == "QuotaReached"]
    assert [e["reason"] for e in entries] == ["Quota reached: gpus 2 in use + 2 asked > 2"]
    submit(cluster, tmp_path, "greedy", namespace="qa", group={"gpus": 4})
    greedy = cluster.wait_for(
        lambda: (d := cluster.json("describe", "qa/greedy"))["status"]["code"] == "QuotaNeverEnough" and d,
        "greedy to wait on its quota",
    )
    assert greedy["status"]["reason"] == (
        "Waits for more than the namespace's quota allows at all (gpus 4 asked > 2): raise the quota or ask for less"
    )
    submit(cluster, tmp_path, "other-ns", sleep=1, group={"gpus": 2})  # default namespace: not held by qa's quota
    assert cluster.wait_state("other-ns", "Completed")["status"]["reason"] == "All workers completed"
    cluster.cli("cancel", "qa/greedy")
    cluster.cli("quota", "rm", "qa")
    described = cluster.wait_for(
        lambda: (d := cluster.json("describe", "qa/pair"))["status"]["reason"] == "2 of 2 workers running" and d,
        "both workers of pair to run once the quota is gone",
    )
    assert cluster.json("quota", "ls") == []
    cluster.cli("cancel", "qa/pair")
    cluster.wait_state("qa/pair", "Cancelled")


def test_a_cordoned_machine_takes_no_new_work_until_uncordoned(cluster: Cluster, tmp_path: Path) -> None:
    cluster.cli("nodes", "cordon", "g0", "--reason", "fan replacement")
    nodes = {n["name"]: n for n in cluster.json("nodes")}
    assert nodes["g0"]["cordon"] == "fan replacement"
    submit(cluster, tmp_path, "patient", sleep=1, group={"gpus": 1})
    described = cluster.wait_for(
        lambda: (d := cluster.describe("patient"))["placement"]["nodes"] and d, "patient to explain its wait"
    )
    assert described["status"]["reason"] == "No machine fits: 2 of 2 machines ready"
    assert described["placement"]["nodes"] == [
        {"name": "c0", "reasons": ["insufficient gpus: need 1, 0 free and usable"]},
        {"name": "g0", "reasons": ["machine is cordoned: fan replacement"]},
    ]
    again = cluster.cli("nodes", "uncordon", "c0", check=False)
    assert (again.returncode, again.stderr.strip()) == (2, "astraeus: machine c0 is not cordoned")
    cluster.cli("nodes", "uncordon", "g0")
    assert cluster.wait_state("patient", "Completed")["tasks"][0]["node"] == "g0"


def test_a_killed_scheduler_comes_back_with_the_same_queue(cluster: Cluster, tmp_path: Path) -> None:
    cluster.cli("quota", "set", "qb", "--gpus", "1")
    submit(cluster, tmp_path, "blocker", priority=9, group={"gpus": 4})
    cluster.wait_state("blocker", "Running")
    submit(cluster, tmp_path, "later", priority=2, sleep=1, group={"gpus": 4})
    submit(cluster, tmp_path, "sooner", priority=4, sleep=1, group={"gpus": 4})
    submit(cluster, tmp_path, "capped", namespace="qb", sleep=1, group={"gpus": 1, "replicas": 2})
    wait_reason(cluster, "later", "Queued behind higher-priority work (sooner)")
    before = {run: reason(cluster, run) for run in ("later", "sooner")}
    cluster.kill("scheduler", signal.SIGKILL)
    cluster.spawn("scheduler", "scheduler")
    cluster.cli("cancel", "blocker")
    sooner = cluster.wait_state("sooner", "Completed")
    later = cluster.wait_state("later", "Completed")
    assert before == {
        "later": "Queued behind higher-priority work (sooner)",
        "sooner": "Next to run (priority 4): waits for running work to end",
    }
    assert sooner["status"]["started_at"] < later["status"]["started_at"]
    capped = cluster.wait_state("qb/capped", "Completed")
    # One worker at a time under the quota of 1 GPU, each started once.
    for task in capped["tasks"]:
        assert [e["state"] for e in task["history"]].count("Starting") == 1
    waited = [e["reason"] for t in capped["tasks"] for e in t["history"]]
    assert "Waits for namespace quota: gpus 1 in use + 1 asked > 1" in waited
    cluster.cli("quota", "rm", "qb")


def test_a_removed_machine_is_forgotten_until_its_agent_registers_again(cluster: Cluster, tmp_path: Path) -> None:
    cluster.cli("nodes", "remove", "c0", "--reason", "decommissioned")
    assert {n["name"]: n["state"] for n in cluster.json("nodes")} == {"c0": "Removed", "g0": "Ready"}
    submit(cluster, tmp_path, "enormous", group={"gpus": 64})
    described = cluster.wait_for(
        lambda: (d := cluster.describe("enormous"))["placement"]["nodes"] and d, "enormous to explain its wait"
    )
    assert described["status"]["reason"] == "No machine fits: 1 of 1 machines ready"
    assert [n["name"] for n in described["placement"]["nodes"]] == ["g0"]
    cluster.kill("c0")
    cluster.spawn_agent("c0", "--cpus", "4", "--memory-bytes", str(8 * GIB), "--pool", "cpu-only")
    cluster.wait_for(
        lambda: {n["name"]: n["state"] for n in cluster.json("nodes")} == {"c0": "Ready", "g0": "Ready"}, "c0 back"
    )
    described = cluster.wait_for(
        lambda: (
            (d := cluster.describe("enormous"))["status"]["reason"] == "No machine fits: 2 of 2 machines ready" and d
        ),
        "enormous to see c0 again",
        timeout=90,
    )
    assert [n["name"] for n in described["placement"]["nodes"]] == ["c0", "g0"]
    cluster.cli("cancel", "enormous")


def test_selection_and_gpu_requests_choose_machines_and_say_why_not(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "pooled", sleep=1, node_selection={"pools": ["cpu-only"]})
    assert cluster.wait_state("pooled", "Completed")["tasks"][0]["node"] == "c0"
    submit(cluster, tmp_path, "picky", group={"gpus": 1, "gpu_requests": [{"model": "H100"}], "healthy_only": True})
    described = cluster.wait_for(
        lambda: (d := cluster.describe("picky"))["placement"]["nodes"] and d, "picky to explain its wait"
    )
    assert described["status"]["reason"] == "No machine fits: 2 of 2 machines ready"
    assert described["placement"]["nodes"] == [
        {"name": "c0", "reasons": ["insufficient gpus: need 1, 0 free and usable"]},
        {"name": "g0", "reasons": ["no H100 GPU"]},
    ]
    cluster.cli("cancel", "picky")
    submit(cluster, tmp_path, "racked", sleep=1, topology={"same_rack": True}, group={"replicas": 2})
    racked = cluster.wait_state("racked", "Completed")
    assert {t["node"] for t in racked["tasks"]} == {"g0"}  # c0 has no rack label


def test_a_group_of_total_gpus_is_split_or_says_why_it_cannot_be(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "huge", group={"total_gpus": 16})
    described = wait_reason(
        cluster, "huge", "Cannot plan workers: no way to run 16 GPUs on these machines: 4 free on the largest one now"
    )
    assert described["tasks"] == []
    cluster.cli("cancel", "huge")
    assert cluster.wait_state("huge", "Cancelled")["status"]["reason"] == "All workers ended; some were cancelled"
    submit(cluster, tmp_path, "split", sleep=1, group={"total_gpus": 4, "machines": 1})
    done = cluster.wait_state("split", "Completed", "Failed")
    assert done["status"]["reason"] == "All workers completed"
    assert [(t["id"], t["node"]) for t in done["tasks"]] == [("w-0", "g0")]
