"""How the CLI shows things to people: machines' conditions, sizes, ages and times (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from workers.listing import RunSummary
from workers.render import age, render_events, render_nodes, render_runs, size
from workflows.domain.inventory import GpuInfo, NodeInventory, NodeState, NodeView
from workflows.domain.run.views import Event

NOW = datetime(2026, 12, 1, 15, 34, 53, 91000, tzinfo=UTC)


def gpu(index: int, fault: str | None = None, at_risk: str | None = None) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index}", model="H100", memory_bytes=80 * 2**30, fault=fault,
                   at_risk=at_risk)  # fmt: skip


def test_a_machine_shows_its_cordon_pressure_and_gpu_faults() -> None:
    inventory = NodeInventory(
        name="g1",
        cpus=64,
        memory_bytes=512 * 2**30,
        gpus=[gpu(0), gpu(1, fault="Xid 79 (GPU has fallen off the bus)"), gpu(2, at_risk="retired pages pending")],
        pressure=["memory"],
    )
    views = [
        NodeView(name="g0", state=NodeState.READY, inventory=NodeInventory(name="g0", cpus=8, memory_bytes=3 * 2**29)),
        NodeView(name="g1", state=NodeState.READY, inventory=inventory, cordon="fan replacement"),
    ]
    assert render_nodes(views).splitlines() == [
        "MACHINE  STATE                    CPUS  MEMORY   GPUS                           CONDITIONS",
        "g0       Ready                    8     1.5 GiB  0                              -",
        "g1       Ready,Cordoned,Pressure  64    512 GiB  3 H100 (1 faulted, 1 at risk)  cordoned: fan replacement; "
        "memory pressure; GPU 1: Xid 79 (GPU has fallen off the bus); GPU 2 at risk: retired pages pending",
    ]


@pytest.mark.parametrize(
    ("n", "shown"), [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (64 * 2**30, "64 GiB"), (3 * 2**50, "3 PiB")]
)
def test_sizes_are_shown_in_binary_units(n: int, shown: str) -> None:
    assert size(n) == shown


@pytest.mark.parametrize(
    ("seconds", "shown"), [(5, "5s"), (119, "119s"), (600, "10m"), (3 * 3600, "3h"), (50 * 3600, "2d")]
)
def test_an_age_is_shown_to_the_unit_that_matters(seconds: float, shown: str) -> None:
    assert age(seconds) == shown


def test_runs_show_their_age_workers_and_gpus() -> None:
    run = RunSummary(namespace="ml", name="train", state="Running", created_at=NOW - timedelta(minutes=12), workers=4,
                     gpus=32)  # fmt: skip
    assert render_runs([run], NOW).splitlines()[1].split() == ["ml", "train", "Running", "12m", "4", "32"]


def test_times_in_utc_are_marked_utc() -> None:
    event = Event(at=NOW, object="run", state="Pending", reason="Run created", code="RunCreated")
    assert render_events([event], utc=True) == "15:34:53.091 UTC  run          Pending      Run created"
