"""Eager starts: a submit through the client that the control plane's worker uses (`astraeus dev`'s API and console)
has the run's first workflow task handed back with the start's answer, at most EAGER_STARTS at a time; a submit
through a client of its own (the CLI, `astraeus api` apart) starts the run as before."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from temporalio.client import Client

import workers.client
from workers.client import AstraeusClient
from workers.connect import connect
from workers.devserver import free_port
from workers.embedded import Embedded
from workflows.domain.spec import JobSpec, job_id, parse_spec

pytestmark = pytest.mark.integration


async def eagerly_started(client: Client, name: str) -> bool:
    """Whether the server took the run's start as eager (its history's first event says so)."""
    history = await client.get_workflow_handle(job_id("default", name)).fetch_history()
    return history.events[0].workflow_execution_started_event_attributes.eager_execution_accepted


def spec(name: str) -> JobSpec:
    return parse_spec({"name": name, "groups": [{"name": "w", "command": ["true"]}]})


async def test_submits_beside_the_control_plane_start_eagerly_at_most_eager_starts_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workers.client, "EAGER_STARTS", 2)
    async with Embedded(tmp_path / "dev", port=free_port(), ui_port=None) as embedded:
        assert embedded.client is not None
        client = AstraeusClient(embedded.client)
        names = [f"burst-{i}" for i in range(5)]
        await asyncio.gather(*(client.submit(spec(n)) for n in names))  # two in flight eager, three not
        await client.submit(spec("after"))  # none in flight: eager again
        async with AstraeusClient(await connect(embedded.server.address)) as apart:  # as the CLI connects: no worker
            await apart.submit(spec("apart"))
        eager = {n: await eagerly_started(embedded.client, n) for n in [*names, "after", "apart"]}
        assert eager == {
            "burst-0": True,
            "burst-1": True,
            "burst-2": False,
            "burst-3": False,
            "burst-4": False,
            "after": True,
            "apart": False,
        }
        for name in eager:  # each run, however it started, runs to its end
            status = await client.result("default", name)
            assert (status.state, status.reason) == ("Completed", "All workers completed")
