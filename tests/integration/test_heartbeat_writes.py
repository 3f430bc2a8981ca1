"""Liveness costs a write per machine per renewal, not one per running worker: a worker's watch sends no heartbeat,
and its machine's lease, renewed three times within the stale grace, carries its liveness (workflows/domain/machine/
liveness.py). Counted by the server, with several workers running on the one machine of the embedded default."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench.server_metrics import between, scrape
from tests.integration.harness import to_running
from workers.client import AstraeusClient
from workers.devserver import free_port
from workers.embedded import Embedded
from workflows.domain.machine.liveness import renew_seconds
from workflows.domain.settings import Settings

pytestmark = pytest.mark.integration

GRACE = 3.0  # the lease renews every second
WINDOW = 10.0
RUNS = ["beats-0", "beats-1", "beats-2", "beats-3"]


async def test_running_workers_cost_no_heartbeat_the_machines_lease_renews_three_times_a_grace(tmp_path: Path) -> None:
    settings = Settings(stale_grace_seconds=GRACE)
    embedded = Embedded(tmp_path / "dev", port=free_port(), ui_port=None, cpus=4, settings=settings)
    embedded.server.metrics_port = free_port()
    async with embedded:
        assert embedded.client is not None
        client = AstraeusClient(embedded.client)
        await to_running(client, RUNS)
        await asyncio.sleep(GRACE)
        port = embedded.server.metrics_port
        before, began = scrape(port), time.monotonic()  # each scrape sees what was counted until FLUSH_SECONDS ago
        await asyncio.sleep(WINDOW)
        after, window = scrape(port), time.monotonic() - began
        beats = between(before, after).requests["RecordActivityTaskHeartbeat"]
        states = [(await client.status("default", name)).state for name in RUNS]
    assert states == ["Running"] * len(RUNS)
    # The lease's renewals only: 10 in 10 s, give or take one at each edge of the window (and the scheduler's own
    # lease, every 5 s). A heartbeat per worker every half of the grace, as before protocol 7, made 13 more.
    expected = window / renew_seconds(settings) + window / 5
    assert expected - 2 <= beats <= expected + 2, f"{beats} heartbeats in {window:.1f} s"
