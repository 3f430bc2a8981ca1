"""The agent's fence (issue 39): once Temporal has recorded no renewal of its machine's lease for the fence, the agent
stops every worker of the machine, takes no start without asking its run, and is itself again when it registers.
What counts is the renewal as Temporal recorded it: the lease activity's last heartbeat, read back from the machine's
workflow."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from temporalio.api.common.v1 import ActivityType
from temporalio.api.workflow.v1 import PendingActivityInfo
from temporalio.api.workflowservice.v1 import DescribeWorkflowExecutionResponse

from activities.agent.drives import DriveActivities, DriveStore
from activities.agent.lease import Lease
from workflows.domain.inventory import NodeInventory, NodeState, NodeView
from workflows.domain.settings import Settings

NODE = "m-0"
SHORT = Settings(node_lease_ttl_seconds=1, fence_after_seconds=2)


class Described:
    """The machine's workflow as its agent's client describes it: its lease activity's last heartbeat."""

    def __init__(self, last_heartbeat: datetime | None) -> None:
        self.last_heartbeat = last_heartbeat
        self.asked: list[str] = []

    def get_workflow_handle(self, workflow_id: str) -> Any:
        async def describe() -> SimpleNamespace:
            self.asked.append(workflow_id)
            pending = PendingActivityInfo(activity_type=ActivityType(name="hold_lease"))
            if self.last_heartbeat is not None:
                stamp = Timestamp()
                stamp.FromDatetime(self.last_heartbeat)
                pending.last_heartbeat_time.CopyFrom(stamp)
            return SimpleNamespace(raw_description=DescribeWorkflowExecutionResponse(pending_activities=[pending]))

        return SimpleNamespace(describe=describe)


def lease(client: Any, settings: Settings = SHORT) -> Lease:
    inventory = NodeInventory(name=NODE, cpus=1, memory_bytes=2**30)
    drives = DriveActivities(client, DriveStore(NODE))
    return Lease(client, inventory, drives, settings, "host:1:token", looks=lambda: None)


async def test_an_agent_unheard_for_its_fence_stops_every_worker_once_and_is_itself_again_when_it_registers() -> None:
    held = lease(Described(None))
    stops: list[int] = []

    async def stop_workers() -> int:
        stops.append(1)
        return 3

    held.confirmed = datetime.now(UTC) - timedelta(seconds=1)  # heard 1 s ago: within its fence (2 s)
    fence = asyncio.ensure_future(held.keep_fence(stop_workers))
    try:
        await asyncio.sleep(0.5)
        assert (stops, held.fenced) == ([], False)
        await asyncio.sleep(1.2)  # now unheard for longer than its fence
        assert (stops, held.fenced) == ([1], True)
        await asyncio.sleep(0.6)
        assert stops == [1]  # once: nothing more to stop until it is heard again
        since = datetime.now(UTC)
        held.took(NodeView(name=NODE, state=NodeState.READY, since=since))
        assert held.fenced is False and held.confirmed >= since
    finally:
        fence.cancel()


async def test_a_start_while_fenced_asks_its_run_first() -> None:
    held = lease(Described(None))
    now = datetime.now(UTC)
    info = SimpleNamespace(attempt=1, started_time=now, current_attempt_scheduled_time=now)
    assert held.doubtful(info) is False  # type: ignore[arg-type]
    held.fenced = True
    assert held.doubtful(info) is True  # type: ignore[arg-type]


async def test_the_fence_counts_from_the_renewal_temporal_recorded_read_back_from_the_machines_workflow() -> None:
    recorded = datetime.now(UTC) + timedelta(seconds=30)  # later than anything the agent saw itself
    client = Described(recorded)
    held = lease(client)
    await held._read_renewal("node/m-0", after=0)
    assert (client.asked, held.confirmed) == (["node/m-0"], recorded)
    client.last_heartbeat = recorded - timedelta(seconds=10)  # an older answer never moves it back
    await held._read_renewal("node/m-0", after=0)
    assert held.confirmed == recorded


async def test_a_renewal_that_cannot_be_read_back_leaves_the_fence_counting() -> None:
    class Unreachable:
        def get_workflow_handle(self, workflow_id: str) -> Any:
            async def describe() -> None:
                raise ConnectionError("cut off")

            return SimpleNamespace(describe=describe)

    held = lease(Unreachable())
    before = held.confirmed
    await held._read_renewal("node/m-0", after=0)
    assert held.confirmed == before
