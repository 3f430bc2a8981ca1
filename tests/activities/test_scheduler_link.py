"""The scheduler's door: a run's `place` and `release` reach the real scheduler service over HTTP, calls made while
it rebuilds wait for it, a scheduler away or a wrong token is an error the local activity tries again, and a bad
address is refused naming it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from activities.scheduler import SchedulerService
from activities.scheduler_link import SchedulerDoor, SchedulerLink, parse_address
from tests.activities.test_scheduler_service import FakeCluster, placements, service
from tests.domain.builders import machine, request
from workers.cli import run
from workflows.domain.reasons import Reason
from workflows.domain.run.events import PlacementUpdate
from workflows.messages import PlaceInput, ReleaseInput


@pytest.fixture
async def door() -> AsyncIterator[SchedulerDoor]:
    door = SchedulerDoor("127.0.0.1:0")
    yield door
    await door.close()


@pytest.mark.parametrize("way", ["http", "in-process"])
async def test_place_and_release_through_the_door_reach_the_scheduler(door: SchedulerDoor, way: str) -> None:
    """By HTTP (the scheduler in another process), or given the door itself (in this process, as `astraeus dev`
    runs it): the same service answers the same."""
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=1)})
    svc = await service(cluster)
    await door.open(svc)
    link = SchedulerLink(door.address if way == "http" else door)
    try:
        first = await link.place(PlaceInput(requests=[request(run="a", gpus=1)]))
        second = await link.place(PlaceInput(requests=[request(run="b", gpus=1)]))
        assert first.answers == [PlacementUpdate(task_id="w-0", attempt=0, node="n0", address="127.0.0.1")]
        assert [(a.node, a.reason) for a in second.answers] == [
            (None, Reason("NextToRunWaits", "Next to run (priority 0): waits for running work to end"))
        ]
        await link.release(ReleaseInput(job_id="job/default/a", task_id="w-0", attempt=0))
        await svc.outbox.idle()
        assert placements(cluster) == [("job/default/b", "w-0", "n0", "")]  # told by signal once room freed
    finally:
        await link.close()


async def test_a_link_given_the_door_calls_its_service_without_http_and_is_refused_until_it_opens(
    door: SchedulerDoor, monkeypatch: pytest.MonkeyPatch
) -> None:
    link = SchedulerLink(door)

    async def no_http(*args: object, **kwargs: object) -> None:
        raise AssertionError("an in-process call went through HTTP")

    monkeypatch.setattr(link._http, "request", no_http)
    try:
        with pytest.raises(RuntimeError) as refused:
            await link.place(PlaceInput(requests=[request(run="a", gpus=1)]))
        assert str(refused.value) == f"the scheduler at {door.address} did not answer /place: its door is not open yet"
        await door.open(await service(FakeCluster(nodes={"n0": machine("n0", gpus=1)})))
        result = await link.place(PlaceInput(requests=[request(run="a", gpus=1)]))
        assert [a.node for a in result.answers] == ["n0"]
        await link.release(ReleaseInput(job_id="job/default/a", task_id="w-0", attempt=0))
    finally:
        await link.close()


async def test_a_call_made_while_the_scheduler_rebuilds_is_refused_at_once_and_answered_once_open(
    door: SchedulerDoor,
) -> None:
    """The door is bound before the rebuild (so the control plane knows it) and opened after: a call meanwhile is
    refused at once, for its local activity to try again, rather than hold its run's workflow task open while the
    rebuild waits for that run to answer."""
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=1)})
    link = SchedulerLink(door.address)
    try:
        with pytest.raises(RuntimeError, match=rf"^the scheduler at {door.address} did not answer /place: Connect"):
            await asyncio.wait_for(link.place(PlaceInput(requests=[request(run="a", gpus=1)])), 5)
        await door.open(await service(cluster))
        result = await link.place(PlaceInput(requests=[request(run="a", gpus=1)]))
        assert [a.node for a in result.answers] == ["n0"]
    finally:
        await link.close()


async def test_a_scheduler_away_is_an_error_that_names_it() -> None:
    closed = SchedulerDoor("127.0.0.1:0")
    address = closed.address
    await closed.close()
    link = SchedulerLink(address)
    try:
        with pytest.raises(RuntimeError, match=rf"^the scheduler at {address} did not answer /place: ConnectError"):
            await link.place(PlaceInput(requests=[request(run="a", gpus=1)]))
    finally:
        await link.close()


async def test_a_door_with_a_token_refuses_calls_without_it(door: SchedulerDoor) -> None:
    guarded = SchedulerDoor("127.0.0.1:0", token="s3cret")
    svc: SchedulerService = await service(FakeCluster(nodes={"n0": machine("n0", gpus=1)}))
    await guarded.open(svc)
    without, wrong, right = (SchedulerLink(guarded.address, token=t) for t in ("", "guess", "s3cret"))
    try:
        for link in (without, wrong):
            with pytest.raises(RuntimeError) as refused:
                await link.place(PlaceInput(requests=[request(run="a", gpus=1)]))
            assert str(refused.value) == (
                f"the scheduler at {guarded.address} answered /place with 401: "
                '{"error":"the scheduler\'s token is missing or wrong"}'
            )
        result = await right.place(PlaceInput(requests=[request(run="a", gpus=1)]))
        assert [a.node for a in result.answers] == ["n0"]
    finally:
        for link in (without, wrong, right):
            await link.close()
        await guarded.close()


@pytest.mark.parametrize("address", ["7244", "localhost", ":7244", "localhost:http", "localhost:70000"])
def test_an_address_that_is_not_host_and_port_is_refused(address: str) -> None:
    with pytest.raises(ValueError) as error:
        parse_address(address)
    assert str(error.value) == f"scheduler address {address!r}: expected HOST:PORT, e.g. 127.0.0.1:7244"


def test_the_scheduler_and_control_commands_refuse_a_bad_address(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["scheduler", "--listen", "nowhere", "--temporal", "127.0.0.1:1"]) == 2
    assert run(["control", "--scheduler", "nowhere:x", "--temporal", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == (
        "astraeus: scheduler address 'nowhere': expected HOST:PORT, e.g. 127.0.0.1:7244\n"
        "astraeus: scheduler address 'nowhere:x': expected HOST:PORT, e.g. 127.0.0.1:7244\n"
    )


async def test_a_second_scheduler_on_the_same_door_is_refused(door: SchedulerDoor) -> None:
    """Once open, at once; while the first still rebuilds, when the second would open."""
    second = SchedulerDoor(door.address)
    svc = await service(FakeCluster(nodes={"n0": machine("n0", gpus=1)}))
    await door.open(svc)
    try:
        with pytest.raises(OSError) as refused:
            await second.open(svc)
        assert str(refused.value) == f"the scheduler cannot listen on {door.address}: Address already in use"
    finally:
        await second.close()
    with pytest.raises(OSError) as error:
        SchedulerDoor(door.address)
    assert str(error.value) == f"the scheduler cannot listen on {door.address}: Address already in use"


async def test_calls_made_together_leave_together_in_one_request() -> None:
    from activities.scheduler_link import Batches

    sent: list[list[int]] = []
    gate = asyncio.Event()

    async def send(items: list[int]) -> list[int]:
        sent.append(items)
        await gate.wait()
        return [item * 10 for item in items]

    batches = Batches(send)
    first = [asyncio.ensure_future(batches.call(i)) for i in range(100)]
    await asyncio.sleep(0.01)
    later = [asyncio.ensure_future(batches.call(i)) for i in range(100, 150)]  # while the first request is out
    await asyncio.sleep(0.01)
    gate.set()
    assert await asyncio.gather(*first, *later) == [i * 10 for i in range(150)]
    assert sent == [list(range(100)), list(range(100, 150))]


async def test_a_request_that_fails_fails_its_calls_only_and_a_call_given_up_is_skipped() -> None:
    from activities.scheduler_link import Batches

    async def send(items: list[int]) -> list[int]:
        await asyncio.sleep(0.01)
        if 13 in items:
            raise RuntimeError("the scheduler at here did not answer /place")
        return items

    batches = Batches(send)
    with pytest.raises(RuntimeError, match="did not answer"):
        await batches.call(13)
    given_up = asyncio.ensure_future(batches.call(7))
    await asyncio.sleep(0)
    given_up.cancel()
    assert await batches.call(8) == 8
    assert given_up.cancelled()


async def test_the_door_tells_what_its_placements_hold_to_a_caller_with_its_token() -> None:
    """The console's free room, from the scheduler's own view: one call, however many runs."""
    guarded = SchedulerDoor("127.0.0.1:0", token="s3cret")
    await guarded.open(await service(FakeCluster(nodes={"n0": machine("n0", gpus=2)})))
    right, wrong = SchedulerLink(guarded.address, token="s3cret"), SchedulerLink(guarded.address, token="guess")
    try:
        await right.place(PlaceInput(requests=[request(run="a", gpus=1)]))
        use = await right.usage()
        assert [(m.name, m.gpus, m.workers, [(p.run, p.task) for p in m.placed]) for m in use.machines] == [
            ("n0", 1, 1, [("a", "w-0")])
        ]
        assert [(w.namespace, w.gpus, w.workers) for w in use.workspaces] == [("default", 1, 1)]
        with pytest.raises(RuntimeError) as refused:
            await wrong.usage()
        assert str(refused.value) == (
            f"the scheduler at {guarded.address} answered /usage with 401: "
            '{"error":"the scheduler\'s token is missing or wrong"}'
        )
    finally:
        for link in (right, wrong):
            await link.close()
        await guarded.close()
