"""What a worker asks of its machine, end to end on a real cluster (dev server, control plane, scheduler and agents
as processes), read back through `astraeus describe --json` and `astraeus nodes --json`: a machine whose agent
refuses runs (`--refuse-runs`), memory that scales with a worker's GPUs (`per_gpu.memory_bytes`), and a port a
worker listens on exposed on its machine (`external_access`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from activities.agent.runtime.cgroups import MemoryCgroups
from tests.integration.harness import Cluster
from workers.devserver import free_port

pytestmark = pytest.mark.integration

GIB, MIB = 2**30, 2**20
OOM = "OOMKilled: the container exceeded its memory limit"
OPEN = ["--gpus", "2xL4-24GB", "--cpus", "4", "--memory-bytes", str(1 * GIB)]
RESERVED = ["--gpus", "8xL4-24GB", "--cpus", "16", "--memory-bytes", str(64 * GIB)]
WHY = "reserved for its owner's experiments"
PLAIN = ["--cpus", "2", "--memory-bytes", str(1 * GIB)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("what-workers-ask"))
    port = free_port()  # a0 exposes one port: a second worker that asks for one waits for it
    try:
        c.start(
            {"a0": [*OPEN, "--external-ports", f"{port}-{port}"], "c0": PLAIN, "r0": [*RESERVED, "--refuse-runs", WHY]}
        )
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, **group: Any) -> None:
    spec = {"name": name, "groups": [{"name": "w", "restart_policy": "Never", "cpu": 0.5, **group}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def waiting(cluster: Cluster, run: str) -> dict[str, Any]:
    return cluster.wait_for(  # type: ignore[no-any-return]
        lambda: (d := cluster.describe(run))["placement"] and d["placement"]["nodes"] and d, f"{run} to say why"
    )


def test_a_machine_that_refuses_runs_says_why_and_takes_them_again_once_its_agent_no_longer_refuses(
    cluster: Cluster, tmp_path: Path
) -> None:
    nodes = {n["name"]: n for n in cluster.json("nodes")}
    assert (nodes["r0"]["inventory"]["refuses_runs"], nodes["r0"]["cordon"]) == (WHY, None)
    assert nodes["a0"]["inventory"]["refuses_runs"] is None

    submit(cluster, tmp_path, "big", command=["true"], gpus=4)
    described = waiting(cluster, "big")
    assert described["status"]["reason"] == "No machine fits: 3 of 3 machines ready"
    assert described["placement"]["nodes"] == [
        {"name": "a0", "reasons": ["insufficient gpus: need 4, 2 free and usable"]},
        {"name": "c0", "reasons": ["insufficient gpus: need 4, 0 free and usable"]},
        {"name": "r0", "reasons": [f"machine does not accept runs: {WHY}"]},
    ]
    # Not a cordon: the cluster's admin verb has nothing to undo; the machine's own agent says it.
    refused = cluster.cli("nodes", "uncordon", "r0", check=False)
    assert (refused.returncode, refused.stderr.strip()) == (2, "astraeus: machine r0 is not cordoned")

    cluster.kill("r0")
    cluster.spawn_agent("r0", *RESERVED)
    done = cluster.wait_state("big", "Completed", "Failed", timeout=90)
    assert (done["status"]["reason"], done["tasks"][0]["node"]) == ("All workers completed", "r0")


def test_memory_per_gpu_places_a_worker_on_its_gpus_times_it(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "roomy", command=["true"], gpus=2, per_gpu={"memory_bytes": 40 * GIB})
    described = waiting(cluster, "roomy")
    reasons = {n["name"]: n["reasons"] for n in described["placement"]["nodes"]}
    assert reasons["a0"] == ["insufficient memory: need 85899345920 bytes, 1073741824 free"]  # 2 x 40 GiB
    cluster.cli("cancel", "roomy")
    cluster.wait_state("roomy", "Cancelled")


def test_memory_per_gpu_limits_a_process_worker_to_its_gpus_times_it(
    cluster: Cluster, tmp_path: Path, memory_cgroups: MemoryCgroups
) -> None:
    greedy = f"sleep 4; exec {sys.executable} -c 'b = bytearray(256 << 20); print(2 * 21)'"
    selection = {"names": ["a0"]}
    submit(cluster, tmp_path, "per-gpu", command=["sh", "-c", greedy], gpus=2, per_gpu={"memory_bytes": 48 * MIB},
           node_selection=selection)  # fmt: skip
    cluster.wait_state("per-gpu", "Running")
    cgroup = memory_cgroups.parent / "default.per-gpu.w-0.0"
    limit = cgroup / ("memory.limit_in_bytes" if memory_cgroups.version == 1 else "memory.max")
    assert int(limit.read_text()) == 2 * 48 * MIB

    described = cluster.wait_state("per-gpu", "Failed", "Completed")
    assert described["status"]["reason"] == f"Worker w-0 failed on a0: {OOM}"
    assert described["tasks"][0]["last_failure"]["reason"] == OOM
    assert "42" not in cluster.cli("logs", "per-gpu/w-0").stdout
    advice = "Raise memory_bytes (or per_gpu.memory_bytes, which its GPUs multiply)."
    assert (
        f"Last failure of w-0: {OOM}\n  The worker used more host memory than its limit. {advice}\n"
        in cluster.cli("describe", "per-gpu").stdout
    )


def serve(cluster: Cluster, tmp_path: Path, name: str, node: str) -> None:
    """A web server as a worker with external access `web`, listening where it is told to."""
    server = f"exec {sys.executable} -m http.server $ASTRAEUS_PORT_WEB --bind 127.0.0.1"
    submit(cluster, tmp_path, name, command=["sh", "-c", server], external_access=[{"name": "web", "port": 8080}],
           node_selection={"names": [node]})  # fmt: skip


def test_external_access_is_served_at_the_port_its_machine_assigns_and_a_second_worker_waits_for_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    ports = {n["name"]: n for n in cluster.json("nodes")}["a0"]["inventory"]["external_ports"]
    port = ports["first"]
    assert ports == {"first": port, "last": port}
    cluster.cli("submit", "examples/web.yaml")  # only a0 exposes ports
    described = cluster.wait_state("web", "Running")
    address = f"127.0.0.1:{port}"
    assert (described["tasks"][0]["node"], described["tasks"][0]["external"]) == ("a0", {"http": address})
    assert f"External access of site-0: http {address}\n" in cluster.cli("describe", "web").stdout + "\n"
    cluster.wait_for(lambda: httpx.get(f"http://{address}/", timeout=2).status_code == 200, "the site to answer")

    serve(cluster, tmp_path, "site-2", "a0")
    waiting = cluster.wait_for(
        lambda: (d := cluster.describe("site-2"))["tasks"][0]["status"]["state"] == "Preparing" and d, "site-2 to wait"
    )
    assert waiting["tasks"][0]["status"]["reason"] == "Waiting for its external port to be assigned"
    assert waiting["status"]["reason"] == "Waiting for its external port to be assigned"
    cluster.cli("cancel", "web")
    again = cluster.wait_state("site-2", "Running")
    assert again["tasks"][0]["external"] == {"web": address}  # the port came free, and went to the one waiting
    cluster.cli("cancel", "site-2")
    cluster.wait_state("site-2", "Cancelled")


def test_external_access_is_not_placed_on_a_machine_that_assigns_no_ports(cluster: Cluster, tmp_path: Path) -> None:
    serve(cluster, tmp_path, "portless", "c0")
    described = waiting(cluster, "portless")
    reasons = {n["name"]: n["reasons"] for n in described["placement"]["nodes"]}
    assert reasons["c0"] == [
        "machine exposes no external ports to its workers (its agent has no --external-ports range)"
    ]
    cluster.cli("cancel", "portless")
