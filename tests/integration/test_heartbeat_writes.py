"""A running worker's heartbeats reach the server every half of the stale grace, not more often: each is a write of
its run's workflow, the most frequent request of a burst (workers/agent_process.py, Agent). Counted by the server."""

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
from workflows.domain.settings import Settings

pytestmark = pytest.mark.integration

GRACE = 2.0  # heartbeats every 1 s; the lease (a TTL of 10 min) renews every 200 s, not within the window
WINDOW = 10.0


async def test_a_running_workers_heartbeats_reach_the_server_every_half_of_the_stale_grace(tmp_path: Path) -> None:
    settings = Settings(stale_grace_seconds=GRACE, node_lease_ttl_seconds=600)
    embedded = Embedded(tmp_path / "dev", port=free_port(), ui_port=None, cpus=4, settings=settings)
    embedded.server.metrics_port = free_port()
    async with embedded:
        assert embedded.client is not None
        client = AstraeusClient(embedded.client)
        await to_running(client, ["beats"])
        await asyncio.sleep(2 * GRACE)  # past its first heartbeat (FIRST_BEAT_INTERVALS), to the steady pace
        port = embedded.server.metrics_port
        before, began = scrape(port), time.monotonic()  # each scrape sees what was counted until FLUSH_SECONDS ago
        await asyncio.sleep(WINDOW)
        after, window = scrape(port), time.monotonic() - began
        beats = between(before, after).requests["RecordActivityTaskHeartbeat"]
        state = (await client.status("default", "beats")).state
    assert state == "Running"
    # One a second: 10 in 10 s, give or take one at each edge of the window; every third of the grace made 15.
    expected = window / (GRACE / 2)
    assert expected - 2 <= beats <= expected + 2, f"{beats} heartbeats in {window:.1f} s"
