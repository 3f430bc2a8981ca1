"""A submit is admitted behind the work of the runs under way: the server takes the new run's write at the lowest
priority of its history shard's I/O slot, and the run's later writes (its tasks, its worker's start) at the usual
one (workers/client.py: SUBMIT_METADATA). Counted by the server."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench.server_metrics import FLUSH_SECONDS, SLOT, Sample, scrape
from workers.client import AstraeusClient
from workers.devserver import free_port
from workers.embedded import Embedded
from workflows.domain.spec import parse_spec

pytestmark = pytest.mark.integration

LOW, HIGH = "1", "0"  # the slot's priorities as the server labels them (locks.PriorityLow, locks.PriorityHigh)


def slot_waits(sample: Sample, priority: str) -> float:
    return sum(
        value
        for (name, labels), value in sample.items()
        if name == "semaphore_latency_count" and ("operation", SLOT) in labels and ("priority", priority) in labels
    )


async def test_a_submits_write_waits_behind_runs_under_way_and_its_run_s_later_writes_do_not(tmp_path: Path) -> None:
    embedded = Embedded(tmp_path / "dev", port=free_port(), ui_port=None, cpus=4)
    embedded.server.metrics_port = free_port()
    async with embedded:
        assert embedded.client is not None
        client = AstraeusClient(embedded.client)
        port = embedded.server.metrics_port
        await asyncio.sleep(FLUSH_SECONDS)
        before = scrape(port)
        await client.submit(parse_spec({"name": "sweep-0", "groups": [{"name": "w", "command": ["sleep", "300"]}]}))
        deadline = time.monotonic() + 60
        while (await client.status("default", "sweep-0")).state != "Running":
            assert time.monotonic() < deadline, "sweep-0 was not Running in 60 s"
            await asyncio.sleep(0.1)
        await asyncio.sleep(FLUSH_SECONDS)
        after = scrape(port)
    submits = slot_waits(after, LOW) - slot_waits(before, LOW)
    under_way = slot_waits(after, HIGH) - slot_waits(before, HIGH)
    assert submits == 1, f"{submits} writes at the lowest priority, {under_way} at the usual one"
    assert under_way >= 2  # at least its worker's start recorded, and the decision that followed its report
