"""What a worker asks of its machine's network, end to end on a real cluster (the dev server, a control plane, a
scheduler and agents as processes): machines report RDMA ports read from fake sysfs trees (`--sysfs`), runs ask
for any RDMA port, InfiniBand at a speed, or a fabric, and a gang stays on one fabric. Read back through `astraeus
describe --json` as a user reads it, whole sentences."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import Cluster

pytestmark = pytest.mark.integration

GIB = 2**30
MACHINE = ["--cpus", "2", "--memory-bytes", str(4 * GIB)]


def sysfs(root: Path, ports: dict[str, tuple[str, str, str]]) -> Path:
    """A fake /sys: for each `device/port`, its (state, rate, link layer) as the kernel writes them."""
    root.mkdir(parents=True)
    for name, (state, rate, link) in ports.items():
        device, port = name.split("/")
        path = root / "class" / "infiniband" / device / "ports" / port
        (path / "gids").mkdir(parents=True)
        (path / "state").write_text(f"{state}\n")
        (path / "rate").write_text(f"{rate}\n")
        (path / "link_layer").write_text(f"{link}\n")
        (path / "gids" / "0").write_text("fe80:0000:0000:0000:0002:c903:0031:7c71\n")
    return root


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("network")
    hdr = ("4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand")
    a = sysfs(root / "sys-a", {"mlx5_0/1": hdr})
    b = sysfs(
        root / "sys-b",
        {"mlx5_0/1": ("4: ACTIVE", "100 Gb/sec (4X EDR)", "InfiniBand"), "mlx5_1/1": (*hdr[:2], "Ethernet")},
    )
    down = sysfs(root / "sys-down", {"mlx5_0/1": ("1: DOWN", "400 Gb/sec (4X NDR)", "InfiniBand")})
    plain = sysfs(root / "sys-plain", {})
    c = Cluster(root)
    try:
        c.start(
            {
                "a0": [*MACHINE, "--sysfs", str(a), "--ib-fabric", "ib-0"],
                "a1": [*MACHINE, "--sysfs", str(a), "--ib-fabric", "ib-0"],
                "b0": [*MACHINE, "--sysfs", str(b), "--ib-fabric", "ib-1"],
                "down": [*MACHINE, "--sysfs", str(down)],
                "plain": [*MACHINE, "--sysfs", str(plain)],
            }
        )
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, groups: list[dict[str, Any]], **fields: Any) -> None:
    spec = {"name": name, "groups": [{"cpu": 2, "command": ["true"], **g} for g in groups], **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def why_not(cluster: Cluster, run: str) -> tuple[str, dict[str, list[str]]]:
    """The run's reason once it explains its wait, and each machine's reasons, by machine."""
    described = cluster.wait_for(lambda: (d := cluster.describe(run))["placement"]["nodes"] and d, f"{run} to wait")
    return described["status"]["reason"], {n["name"]: n["reasons"] for n in described["placement"]["nodes"]}


def machines_of(described: dict[str, Any]) -> list[str]:
    return sorted(t["node"] for t in described["tasks"])


def test_a_run_asking_for_rdma_or_infiniband_hears_each_machine_s_ports(cluster: Cluster, tmp_path: Path) -> None:
    submit(
        cluster,
        tmp_path,
        "rdma",
        [{"name": "w", "network": {"rdma": True}}],
        node_selection={"names": ["down", "plain"]},
    )
    assert why_not(cluster, "rdma") == (
        "No machine fits: 5 of 5 machines ready",
        {
            "a0": ["machine is not among the selected names"],
            "a1": ["machine is not among the selected names"],
            "b0": ["machine is not among the selected names"],
            "down": ["no active RDMA port"],
            "plain": ["no active RDMA port"],
        },
    )
    cluster.cli("cancel", "rdma")

    submit(cluster, tmp_path, "fast", [{"name": "w", "network": {"infiniband_gbps": 800}}])
    assert why_not(cluster, "fast")[1] == {
        "a0": ["no active InfiniBand port at 800 Gb/s or faster (mlx5_0/1 active at 400 Gb/s)"],
        "a1": ["no active InfiniBand port at 800 Gb/s or faster (mlx5_0/1 active at 400 Gb/s)"],
        "b0": ["no active InfiniBand port at 800 Gb/s or faster (mlx5_0/1 active at 100 Gb/s)"],
        "down": ["no active InfiniBand port at 800 Gb/s or faster (mlx5_0/1 down at 400 Gb/s)"],
        "plain": ["no active InfiniBand port at 800 Gb/s or faster (no InfiniBand port)"],
    }
    cluster.cli("cancel", "fast")

    submit(cluster, tmp_path, "roce", [{"name": "w", "network": {"rdma": True}}], node_selection={"names": ["b0"]})
    assert machines_of(cluster.wait_state("roce", "Completed")) == ["b0"]


def test_a_run_asking_for_a_fabric_goes_there(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "on-ib1", [{"name": "w", "network": {"fabric": "ib-1"}}])
    assert machines_of(cluster.wait_state("on-ib1", "Completed")) == ["b0"]

    submit(
        cluster, tmp_path, "on-ib9", [{"name": "w", "network": {"fabric": "ib-9"}}], node_selection={"names": ["a0"]}
    )
    assert why_not(cluster, "on-ib9")[1]["a0"] == [
        "no active InfiniBand port on fabric ib-9 (mlx5_0/1 active at 400 Gb/s on fabric ib-0)"
    ]
    cluster.cli("cancel", "on-ib9")


def test_a_gang_asking_for_infiniband_stays_on_one_fabric(cluster: Cluster, tmp_path: Path) -> None:
    # Each worker takes a whole machine (2 cpus): two fit on ib-0 together; three would need ib-1 too.
    submit(cluster, tmp_path, "pair", [{"name": "w", "replicas": 2, "network": {"infiniband_gbps": 100}}], gang=True)
    assert machines_of(cluster.wait_state("pair", "Completed")) == ["a0", "a1"]

    submit(cluster, tmp_path, "trio", [{"name": "w", "replicas": 3, "network": {"infiniband_gbps": 100}}], gang=True)
    reason, nodes = why_not(cluster, "trio")
    assert reason == "Gang cannot be placed whole: 5 of 5 machines ready"
    assert nodes["b0"] == [
        "no active InfiniBand port at 100 Gb/s or faster (mlx5_0/1 active at 100 Gb/s on fabric ib-1; its gang is on "
        "fabric ib-0)"
    ]
    cluster.cli("cancel", "trio")
