"""A run submitted beside the control plane lists, at its start, the build of the control plane's worker in Temporal's
BuildIds attribute, as the server lists it at the run's first workflow task: the server finds nothing to add, and
writes the run's listing once fewer on its way to Running (workers/client.py: BUILD_IDS_KEY)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from bench.server_metrics import FLUSH_SECONDS, between, scrape
from tests.integration.harness import to_running
from workers.client import BUILD_IDS_KEY, AstraeusClient, listed_builds
from workers.devserver import free_port
from workers.embedded import Embedded
from workflows.contracts import SA_STATE
from workflows.domain.spec import job_id

pytestmark = pytest.mark.integration

UPSERT = "UpsertWorkflowExecution"  # a write of a run's listing after its start


async def listed_running(client: AstraeusClient, names: list[str]) -> None:
    """Until the runs' listings say Running: the server's visibility queue wrote their last listing."""
    ids = " OR ".join(f"WorkflowId = '{job_id('default', n)}'" for n in names)
    deadline = time.monotonic() + 60
    while (await client.temporal.count_workflows(f"{SA_STATE} = 'Running' AND ({ids})")).count != len(names):
        assert time.monotonic() < deadline, f"{names} not listed Running in 60 s"
        await asyncio.sleep(0.1)


async def listing_writes(client: AstraeusClient, port: int, names: list[str]) -> int:
    """The server's writes of the runs' listings after their starts, from submit to Running as listed."""
    await asyncio.sleep(FLUSH_SECONDS)
    before = scrape(port)
    await to_running(client, names)
    await listed_running(client, names)
    await asyncio.sleep(FLUSH_SECONDS)  # the counters of those writes published
    return between(before, scrape(port)).visibility[UPSERT]


async def test_a_run_started_beside_the_control_plane_lists_its_build_and_is_listed_once_fewer(tmp_path: Path) -> None:
    embedded = Embedded(tmp_path / "dev", port=free_port(), ui_port=None, cpus=64, memory_bytes=64 << 30)
    embedded.server.metrics_port = free_port()
    async with embedded:
        assert embedded.client is not None and embedded.control_build is not None
        port = embedded.server.metrics_port
        beside = AstraeusClient(embedded.client, control_build=embedded.control_build)
        plain = AstraeusClient(embedded.client)  # as a client without the control plane's build (the CLI)
        listed = await listing_writes(beside, port, ["beside-0", "beside-1", "beside-2"])
        unlisted = await listing_writes(plain, port, ["plain-0", "plain-1", "plain-2"])
        builds = {}
        for name in ["beside-0", "plain-0"]:
            described = await embedded.client.get_workflow_handle(job_id("default", name)).describe()
            builds[name] = described.typed_search_attributes.get(BUILD_IDS_KEY)
    # What the server lists for a run the control plane's worker took is what the client listed at the start.
    assert builds == {name: listed_builds(embedded.control_build) for name in builds}
    # Each run's listing written once to Running (its state) where the server wrote it twice (the build, the state).
    assert (listed, unlisted) == (3, 6)
