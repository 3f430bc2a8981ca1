"""A submit is admitted behind the work of the runs under way: the server takes the new run's write at the lowest
priority of its history shard's I/O slot, and the run's later writes (its tasks, its worker's start) at the usual
one; and its first workflow task waits in the queue in its turn, never started eagerly past the runs submitted
before it (workers/client.py: SUBMIT_METADATA). Counted by the server, and read from the runs' histories."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client

from bench.server_metrics import FLUSH_SECONDS, SLOT, Sample, scrape
from tests.integration.harness import to_running
from workers.client import AstraeusClient
from workers.devserver import free_port
from workers.embedded import Embedded
from workflows.domain.spec import JobSpec, job_id, parse_spec

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
        await to_running(client, ["sweep-0"])
        await asyncio.sleep(FLUSH_SECONDS)
        after = scrape(port)
    submits = slot_waits(after, LOW) - slot_waits(before, LOW)
    under_way = slot_waits(after, HIGH) - slot_waits(before, HIGH)
    assert submits == 1, f"{submits} writes at the lowest priority, {under_way} at the usual one"
    assert under_way >= 2  # at least its worker's start recorded, and the decision that followed its report


async def eagerly_started(client: Client, name: str) -> bool:
    """Whether the server took the run's start as eager (its history's first event says so)."""
    history = await client.get_workflow_handle(job_id("default", name)).fetch_history()
    return history.events[0].workflow_execution_started_event_attributes.eager_execution_accepted


def spec(name: str) -> JobSpec:
    return parse_spec({"name": name, "groups": [{"name": "w", "command": ["true"]}]})


async def test_submits_beside_the_control_plane_start_their_runs_through_the_queue_in_their_turn(
    tmp_path: Path,
) -> None:
    """The client that the control plane's worker uses (`astraeus dev`'s API and console) could have the server start
    a run's first task eagerly, in the start's own write, and hand it to that worker: past the queue, and ahead of the
    runs submitted before it. None is, alone or in a burst."""
    async with Embedded(tmp_path / "dev", port=free_port(), ui_port=None) as embedded:
        assert embedded.client is not None
        client = AstraeusClient(embedded.client, control_build=embedded.control_build)
        names = [f"burst-{i}" for i in range(5)]
        await asyncio.gather(*(client.submit(spec(n)) for n in names))
        await client.submit(spec("alone"))
        eager = {n: await eagerly_started(embedded.client, n) for n in [*names, "alone"]}
        assert eager == dict.fromkeys([*names, "alone"], False)
        for name in eager:
            status = await client.result("default", name)
            assert (status.state, status.reason) == ("Completed", "All workers completed")
