"""A machine whose agent reads its GPUs through NVML (the real pynvml, a fake libnvidia-ml.so.1): it registers
them, and reports a GPU that faults while it runs to its NodeWorkflow."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import Cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("nvml-cluster"))
    try:
        c.start({})
        yield c
    finally:
        c.stop()


def gpus_of(cluster: Cluster, node: str) -> list[dict[str, Any]]:
    view = next(v for v in cluster.json("nodes") if v["name"] == node)
    return view["inventory"]["gpus"]  # type: ignore[no-any-return]


def test_an_agent_registers_its_nvml_gpus_and_reports_a_fault(
    cluster: Cluster, fake_nvml: Path, tmp_path: Path
) -> None:
    xid = tmp_path / "xid"
    xid.write_text("")
    env = {
        "LD_LIBRARY_PATH": str(fake_nvml),
        "FAKE_NVML_COUNT": "4",
        "FAKE_NVML_PAGES_PENDING": "2",
        "FAKE_NVML_XID_FILE": str(xid),
    }
    cluster.spawn_agent("gpu0", "--cpus", "8", env=env)
    cluster.wait_for(lambda: any(v["name"] == "gpu0" for v in cluster.json("nodes")), "gpu0 to register")

    view = next(v for v in cluster.json("nodes") if v["name"] == "gpu0")
    assert view["inventory"]["gpu_source"] == "nvml"
    assert [(g["index"], g["uuid"], g["model"], g["fault"], g["at_risk"]) for g in view["inventory"]["gpus"]] == [
        (0, "GPU-fake-0", "NVIDIA H100 80GB HBM3", None, None),
        (1, "GPU-fake-1", "NVIDIA H100 80GB HBM3", None, None),
        (2, "GPU-fake-2", "NVIDIA H100 80GB HBM3", None, "retired pages pending"),
        (3, "GPU-fake-3", "NVIDIA H100 80GB HBM3", None, None),
    ]

    with xid.open("a") as events:
        events.write("3 79\n")
    gpus = cluster.wait_for(lambda: (g := gpus_of(cluster, "gpu0"))[3]["fault"] and g, "GPU 3's fault reported")

    assert [(g["fault"], g["at_risk"]) for g in gpus] == [
        (None, None),
        (None, None),
        (None, "retired pages pending"),
        ("Xid 79 (GPU has fallen off the bus)", None),
    ]
    history = next(v for v in cluster.json("nodes") if v["name"] == "gpu0")["history"]
    assert (history[-1]["state"], history[-1]["reason"]) == (
        "Ready",
        "gpu fault on the machine: GPU 3: Xid 79 (GPU has fallen off the bus)",
    )
