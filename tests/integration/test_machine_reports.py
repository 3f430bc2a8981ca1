"""What an agent reports of its machine, end to end on a real cluster (dev server, control plane, scheduler and an
agent as processes): declared RDMA ports, capabilities with a note, its data location's room, and memory pressure
read from a /proc (--procfs) that the test changes while the agent runs. A run exercises pressure; runs that ask
for RDMA and capabilities are in test_network_and_capabilities.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.agent.capabilities import MESH_NEEDS
from activities.agent.node_network import PROCESS_NETWORK
from activities.agent.runtime.process import PROCESS_SANDBOX
from tests.integration.harness import Cluster

pytestmark = pytest.mark.integration

GIB = 2**30


def meminfo(procfs: Path, available_kb: int) -> None:
    procfs.mkdir(exist_ok=True)
    text = f"MemTotal:       16000000 kB\nMemFree:        {available_kb} kB\nMemAvailable:   {available_kb} kB\n"
    (procfs / "meminfo.new").write_text(text)
    (procfs / "meminfo.new").replace(procfs / "meminfo")  # the agent never reads half a file


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("machine-reports")
    meminfo(root / "proc", 8_000_000)
    (root / "data").mkdir()
    c = Cluster(root)
    try:
        flags = ["--cpus", "4", "--memory-bytes", str(8 * GIB), "--procfs", str(root / "proc")]
        flags += ["--rdma-port", "mlx5_0:InfiniBand:100:ib-0", "--rdma-port", "mlx5_1:RoCE:25"]
        flags += ["--tool-gateway", "http://gateway.internal:9000"]
        flags += ["--capability-note", "outbound_policy=no egress proxy on this rack"]
        flags += ["--data-location", str(root / "data")]
        c.start({"m0": flags})
        yield c
    finally:
        c.stop()


def node(cluster: Cluster) -> dict[str, Any]:
    [view] = cluster.json("nodes")
    return view  # type: ignore[no-any-return]


def test_the_agent_reports_its_ports_capabilities_room_and_pressure_and_runs_wait_out_pressure(
    cluster: Cluster, tmp_path: Path
) -> None:
    inventory = node(cluster)["inventory"]
    assert inventory["ports"] == [
        {"name": "mlx5_0", "link": "InfiniBand", "active": True, "speed_gbps": 100, "fabric": "ib-0"},
        {"name": "mlx5_1", "link": "Ethernet", "active": True, "speed_gbps": 25, "fabric": None},
    ]
    assert inventory["capabilities"] == ["tool_gateway"]
    assert inventory["capability_notes"] == {
        "outbound_policy": "no egress proxy on this rack",
        "sandbox": PROCESS_SANDBOX,
        "node_network": PROCESS_NETWORK,
        "mesh": MESH_NEEDS,
    }
    assert inventory["data_free_bytes"] > 0
    assert inventory["pressure"] == []

    meminfo(cluster.root / "proc", 400_000)  # 2.5% available: the lease's holder sees it within 5 s
    view = cluster.wait_for(lambda: (v := node(cluster))["inventory"]["pressure"] == ["memory"] and v, "pressure")
    assert [e["reason"] for e in view["history"]] == ["Registered by its agent", "under pressure: memory"]

    spec = {"name": "squeezed", "groups": [{"name": "w", "command": ["true"], "cpu": 0.5}]}
    (tmp_path / "squeezed.yaml").write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(tmp_path / "squeezed.yaml"))
    described = cluster.wait_for(
        lambda: (d := cluster.describe("squeezed"))["placement"] and d["placement"]["nodes"] and d, "why it waits"
    )
    assert described["status"]["state"] == "Pending"
    assert described["placement"]["nodes"] == [{"name": "m0", "reasons": ["under pressure: memory"]}]

    meminfo(cluster.root / "proc", 8_000_000)  # the pressure passes: the run is placed and ends
    done = cluster.wait_state("squeezed", "Completed", "Failed")
    assert done["status"]["reason"] == "All workers completed"
    assert node(cluster)["inventory"]["pressure"] == []
