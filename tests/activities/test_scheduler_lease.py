"""Two scheduler processes on one Temporal: exactly one holds the lease and places; the other waits as a standby, its
door refusing every call saying who holds the lease; when the holder goes (its lease expires), the standby takes over
in the next epoch and places; a scheduler that lost its lease places nothing. Real workers of the lease's workflow and
activity, on a dev server of their own."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.scheduler import SchedulerService
from activities.scheduler_lease import SchedulerLeaseHolder
from activities.scheduler_link import EPOCH_HEADER, SchedulerDoor, SchedulerLink
from tests.activities.test_scheduler_service import FakeCluster, service
from tests.domain.builders import machine, request
from workers.devserver import free_port
from workers.services import SchedulerWorker
from workflows import contracts
from workflows.contracts import CONTROL_TASK_QUEUE
from workflows.domain.settings import Settings
from workflows.messages import PlaceInput
from workflows.scheduler_lease import SchedulerLeaseWorkflow

BIN = Path(sys.executable).parent
TTL = 3.0


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    """A client of a dev server of its own (in real time: a lease's timers must not skip), with a control plane's
    worker of the lease's workflow (in the sandbox)."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        data_converter=pydantic_data_converter,
        port=free_port(),
        ui=False,
    )
    try:
        async with Worker(env.client, task_queue=CONTROL_TASK_QUEUE, workflows=[SchedulerLeaseWorkflow]):
            yield env.client
    finally:
        await env.shutdown()


async def scheduler(server: Client, name: str, made: list[SchedulerService]) -> SchedulerWorker:
    """A scheduler process, with a client of its own (a client serves one worker of a queue), whose view is a fake
    cluster's."""
    client = await Client.connect(server.service_client.config.target_host, data_converter=pydantic_data_converter)

    async def new_service(epoch: int) -> SchedulerService:
        svc = await service(FakeCluster(nodes={"n0": machine("n0", gpus=1)}))
        svc.epoch = epoch
        made.append(svc)
        return svc

    lease = SchedulerLeaseHolder(client, Settings(scheduler_lease_ttl_seconds=TTL), instance=f"elsewhere:1:{name}")
    return SchedulerWorker(client, SchedulerDoor("127.0.0.1:0"), lease, new_service)


async def until(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not in {seconds} s: {what}"
        await asyncio.sleep(0.05)


async def test_one_holds_the_lease_the_other_waits_as_a_standby_and_takes_over_when_it_expires(client: Client) -> None:
    made_a: list[SchedulerService] = []
    made_b: list[SchedulerService] = []
    a, b = await scheduler(client, "a", made_a), await scheduler(client, "b", made_b)
    await a.start()
    await b.start()  # the lease is a's: b is refused, and waits
    running = [asyncio.ensure_future(s.run()) for s in (a, b)]
    http = httpx.AsyncClient()
    try:
        assert (a.lease.epoch, a.lease.holds(), b.lease.holds(), len(made_b)) == (1, True, False, 0)
        held = await contracts.query(client.get_workflow_handle("scheduler"), contracts.LEASE)
        assert (held.holder, held.epoch) == ("elsewhere:1:a", 1)
        await until(lambda: a.door.service is not None and b.door.refusal.startswith("standby"), 5, "doors set")
        refused = await http.post(f"http://{b.door.address}/place", json=[])
        assert (refused.status_code, refused.json()) == (
            503,
            {"error": "standby: scheduler elsewhere:1:a holds the lease (epoch 1)"},
        )
        placed = await http.post(f"http://{a.door.address}/place", content=_place("r1"))
        assert (placed.status_code, placed.headers[EPOCH_HEADER]) == (200, "1")
        assert placed.json()[0]["answers"][0]["node"] == "n0"
        # A control process pointed at the standby keeps being refused, for its local activity to try again.
        link = SchedulerLink(b.door.address)
        with pytest.raises(RuntimeError, match=r"answered /place with 503: .*standby: scheduler elsewhere:1:a"):
            await link.place(PlaceInput(requests=[request(run="r2", gpus=1)]))
        # a goes away without a word (its lease's worker stops renewing): its lease expires, b takes over.
        await a._lease_worker.shutdown()
        gone_at = time.monotonic()
        await until(lambda: b.door.service is not None, 2 * TTL + 2, "b to take over")
        assert time.monotonic() - gone_at < TTL + TTL / 6 + 1.5
        assert (b.lease.epoch, len(made_b)) == (2, 1)
        answer = await link.place(PlaceInput(requests=[request(run="r2", gpus=1)]))
        assert [x.node for x in answer.answers] == ["n0"]
        await link.close()
        # a lost its lease: its term's service decides nothing more, and a waits as b's standby.
        await until(lambda: a.door.refusal.startswith("standby"), 2 * TTL, "a to be a standby")
        refused = await http.post(f"http://{a.door.address}/place", content=_place("r3"))
        assert (refused.status_code, refused.json()) == (
            503,
            {"error": "standby: scheduler elsewhere:1:b holds the lease (epoch 2)"},
        )
        with pytest.raises(RuntimeError, match="the scheduler places nothing: it lost its lease"):
            await made_a[0].place(PlaceInput(requests=[request(run="r3", gpus=1)]))
    finally:
        await http.aclose()
        for s in (a, b):
            await s.shutdown()
        await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 20)


async def test_a_scheduler_shut_down_leaves_no_sweep_behind(client: Client) -> None:
    """A scheduler shut down (the embedded default's exit, a benchmark's cluster) leaves no sweep behind that would
    go on calling a server that is gone."""
    made: list[SchedulerService] = []
    only = await scheduler(client, "only", made)
    await only.start()
    running = asyncio.ensure_future(only.run())
    await until(lambda: made and made[0].sweeping is not None, 5, "the sweep to start")
    sweeping = made[0].sweeping
    assert sweeping is not None and not sweeping.done()
    await only.shutdown()
    await asyncio.wait_for(running, 10)
    assert sweeping.cancelled()


def _place(run: str) -> bytes:
    from activities.scheduler_link import PLACES

    return PLACES.dump_json([PlaceInput(requests=[request(run=run, gpus=1)])])
