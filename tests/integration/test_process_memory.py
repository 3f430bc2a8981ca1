"""What a user sees of `memory_bytes` on a machine that runs workers as processes (`astraeus agent`, the default
runtime), on a real cluster: a worker over its limit is killed by the kernel and fails "OOMKilled: the container
exceeded its memory limit", as on a docker machine; one within it runs to the end inside its cgroup; neither leaves
its cgroup behind. As root these tests need memory cgroups and fail without them (CI runs as root)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.runtime.cgroups import MemoryCgroups, Unenforced, find_memory_cgroups
from tests.integration.harness import Cluster

pytestmark = pytest.mark.integration

GIB, MIB = 2**30, 2**20
NODE = "m0"
OOM = "OOMKilled: the container exceeded its memory limit"


def memory_cgroups() -> MemoryCgroups:
    """Where the agent (a child of this process, in its cgroup) makes them. As root they must work: fail loudly."""
    found = find_memory_cgroups()
    if isinstance(found, Unenforced):
        if os.geteuid() != 0:
            pytest.skip(f"memory cgroups need root: {found.why}")
        pytest.fail(f"running as root, yet memory cgroups cannot be used: {found.why}")
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    memory_cgroups()
    c = Cluster(tmp_path_factory.mktemp("memory-cluster"))
    try:
        c.start({NODE: ["--cpus", "4", "--memory-bytes", str(8 * GIB)]})
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, **group: Any) -> None:
    spec = {"name": name, "groups": [{"name": "w", "restart_policy": "Never", **group}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def test_a_process_worker_over_its_memory_bytes_fails_oom_killed(cluster: Cluster, tmp_path: Path) -> None:
    greedy = [sys.executable, "-c", "b = bytearray(256 << 20); print('survived')"]
    submit(cluster, tmp_path, "mem-oom", command=greedy, memory_bytes=64 * MIB)

    described = cluster.wait_state("mem-oom", "Failed", "Completed")

    assert described["status"]["reason"] == f"Worker w-0 failed on {NODE}: {OOM}"
    worker = described["tasks"][0]
    assert (worker["last_failure"]["exit_code"], worker["last_failure"]["reason"]) == (137, OOM)
    assert [(e["state"], e["reason"]) for e in worker["history"]][-1] == ("Failed", OOM)
    assert "survived" not in cluster.cli("logs", "mem-oom/w-0").stdout
    assert not (memory_cgroups().parent / "default.mem-oom.w-0.0").exists()


def test_a_process_worker_within_its_memory_bytes_runs_in_its_cgroup_to_the_end(
    cluster: Cluster, tmp_path: Path
) -> None:
    submit(cluster, tmp_path, "mem-ok", command=["sh", "-c", "cat /proc/self/cgroup; echo done"], memory_bytes=64 * MIB)

    described = cluster.wait_state("mem-ok", "Completed", "Failed")

    assert described["status"]["reason"] == "All workers completed"
    cgroup = memory_cgroups().parent / "default.mem-ok.w-0.0"
    log = cluster.cli("logs", "mem-ok/w-0").stdout
    assert f"/{cgroup.parent.name}/{cgroup.name}\n" in log and log.endswith("done\n")
    assert not cgroup.exists()
