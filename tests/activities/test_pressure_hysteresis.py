"""Pressure with hysteresis: a machine comes under pressure below 5% free and leaves it only above 7%, so one that
hovers at the 5% line does not flap (each change is an update to its workflow and a line in its history)."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from pathlib import Path

import pytest
from temporalio.testing import ActivityEnvironment

from activities.agent.machine import PressureWatch, disk_pressure, memory_pressure, under_pressure
from tests.activities.test_machine import lease_holder, meminfo
from workflows.domain.machine.decisions import PressureReported
from workflows.messages import LeaseInput


@pytest.mark.parametrize(
    ("free", "was", "under"),
    [
        (100, False, False),
        (50, False, False),
        (49, False, True),
        (49, True, True),
        (50, True, True),
        (69, True, True),
        (70, True, False),
        (100, True, False),
    ],
    ids=[
        "plenty free: not under",
        "exactly 5% free: not under",
        "below 5%: under",
        "still below 5%: still under",
        "back at 5%: still under",
        "just below 7%: still under",
        "7% free: cleared",
        "plenty free again: cleared",
    ],
)
def test_pressure_begins_below_5_percent_and_clears_only_at_7(free: int, was: bool, under: bool) -> None:
    assert under_pressure(free, 1000, was) is under


def test_a_size_unknown_is_never_under_pressure() -> None:
    assert under_pressure(0, 0, True) is False


def test_memory_and_disk_readers_take_what_the_machine_was_under(tmp_path: Path) -> None:
    procfs = meminfo(tmp_path / "proc", 1_000_000, 60_000)  # 6% available
    assert (memory_pressure(procfs), memory_pressure(procfs, was=True)) == (False, True)
    assert disk_pressure(tmp_path, was=True) is disk_pressure(tmp_path, was=True)  # the real disk: consistent
    watch = PressureWatch(tmp_path, procfs)
    assert "memory" not in watch.poll()
    assert "memory" in watch.poll(under=["memory"])


async def test_the_lease_holder_reports_a_machine_at_the_5_percent_line_once(tmp_path: Path) -> None:
    if disk_pressure(tmp_path):
        pytest.skip("this machine's own disk is under pressure")
    procfs = meminfo(tmp_path / "proc", 1_000_000, 900_000)
    agent, workflows = lease_holder(tmp_path, PressureWatch(tmp_path, procfs))
    holding = asyncio.ensure_future(
        ActivityEnvironment().run(agent.hold_lease, LeaseInput(node="n0", renew_seconds=0.02))
    )
    try:
        for available_kb in [49_000, 51_000, 49_000, 60_000, 50_000, 69_000, 71_000, 60_000]:
            meminfo(procfs, 1_000_000, available_kb)
            await asyncio.sleep(0.15)  # a few looks
    finally:
        holding.cancel()
        with suppress(BaseException):
            await holding
    assert workflows.updates == [("node/n0", "report_pressure", PressureReported(pressure=p)) for p in (["memory"], [])]
