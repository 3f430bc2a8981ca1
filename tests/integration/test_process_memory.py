"""What a user sees of `memory_bytes` on a machine that runs workers as processes (`astraeus agent`, the default
runtime), on a real cluster: a worker over its limit is killed by the kernel and fails "OOMKilled: the container
exceeded its memory limit", as on a docker machine; one within it runs to the end inside its cgroup; neither leaves
its cgroup behind. As root these tests need memory cgroups and fail without them (CI runs as root): the fixture
memory_cgroups (tests/conftest.py)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.agent.runtime.cgroups import MemoryCgroups
from tests.integration.harness import Cluster

pytestmark = pytest.mark.integration

GIB, MIB = 2**30, 2**20
NODE = "m0"
FLAGS = ["--cpus", "4", "--memory-bytes", str(8 * GIB)]
OOM = "OOMKilled: the container exceeded its memory limit"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, memory_cgroups: MemoryCgroups) -> Iterator[Cluster]:
    # The machine's lease outlasts an agent restart (kill -9, then start again): its workers are re-attached.
    c = Cluster(tmp_path_factory.mktemp("memory-cluster"), node_lease_ttl_seconds=30)
    try:
        c.start({NODE: FLAGS})
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, **group: Any) -> None:
    spec = {"name": name, "groups": [{"name": "w", "restart_policy": "Never", **group}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def test_a_process_worker_over_its_memory_bytes_fails_oom_killed(
    cluster: Cluster, tmp_path: Path, memory_cgroups: MemoryCgroups
) -> None:
    greedy = [sys.executable, "-c", "b = bytearray(256 << 20); print('survived')"]
    submit(cluster, tmp_path, "mem-oom", command=greedy, memory_bytes=64 * MIB)

    described = cluster.wait_state("mem-oom", "Failed", "Completed")

    assert described["status"]["reason"] == f"Worker w-0 failed on {NODE}: {OOM}"
    worker = described["tasks"][0]
    assert (worker["last_failure"]["exit_code"], worker["last_failure"]["reason"]) == (137, OOM)
    assert [(e["state"], e["reason"]) for e in worker["history"]][-1] == ("Failed", OOM)
    assert "survived" not in cluster.cli("logs", "mem-oom/w-0").stdout
    assert not (memory_cgroups.parent / "default.mem-oom.w-0.0").exists()


def test_a_process_worker_within_its_memory_bytes_runs_in_its_cgroup_to_the_end(
    cluster: Cluster, tmp_path: Path, memory_cgroups: MemoryCgroups
) -> None:
    submit(cluster, tmp_path, "mem-ok", command=["sh", "-c", "cat /proc/self/cgroup; echo done"], memory_bytes=64 * MIB)

    described = cluster.wait_state("mem-ok", "Completed", "Failed")

    assert described["status"]["reason"] == "All workers completed"
    cgroup = memory_cgroups.parent / "default.mem-ok.w-0.0"
    log = cluster.cli("logs", "mem-ok/w-0").stdout
    assert f"/{cgroup.parent.name}/{cgroup.name}\n" in log and log.endswith("done\n")
    assert not cgroup.exists()


def test_a_restarted_agent_reports_the_oom_kill_of_a_worker_its_predecessor_started(
    cluster: Cluster, tmp_path: Path, memory_cgroups: MemoryCgroups
) -> None:
    late_greed = f"echo started; sleep 6; exec {sys.executable} -c 'b = bytearray(256 << 20)'"
    submit(cluster, tmp_path, "mem-adopted", command=["sh", "-c", late_greed], memory_bytes=64 * MIB)
    cluster.wait_state("mem-adopted", "Running")

    cluster.kill(NODE, signal.SIGKILL)
    cluster.spawn_agent(NODE, *FLAGS)

    described = cluster.wait_state("mem-adopted", "Failed", "Completed", timeout=90)
    assert described["status"]["reason"] == f"Worker w-0 failed on {NODE}: {OOM}"
    worker = described["tasks"][0]
    assert [e for e in worker["history"] if e["state"] == "Starting"] == [worker["history"][3]]  # started once
    assert worker["last_failure"]["reason"] == OOM
    assert not (memory_cgroups.parent / "default.mem-adopted.w-0.0").exists()
