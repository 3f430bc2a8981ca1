"""NodeWorkflow's probation (issue 39): a lease whose expiry reaches the workflow late (its last renewal, as the agent
sent it with that renewal, lies well before) waits for its agent to register again; a machine whose agent does was
never lost, and no run hears of it. One that does not is lost once the probation is over, as before.

On a dev server of its own, in real time: the time-skipping server keeps no heartbeat details on a timeout."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import FakeMachine, machine_workflow, unique
from workers.connect import ensure_search_attributes
from workers.devserver import free_port
from workflows.domain.inventory import NodeInventory
from workflows.domain.machine.decisions import Registered
from workflows.domain.settings import Settings
from workflows.messages import LeaseInput
from workflows.node import NodeWorkflow

BIN = Path(sys.executable).parent
LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)  # the last renewal the agent says it made: any expiry is late after it


class LateMachine(FakeMachine):
    """An agent whose renewals say they were made long ago: its lease's expiry always reads late."""

    @activity.defn(name="hold_lease")
    async def hold_lease(self, input: LeaseInput) -> None:
        while self.alive:
            activity.heartbeat(LONG_AGO.isoformat())
            await asyncio.sleep(input.renew_seconds)
        await asyncio.sleep(30)


@pytest.fixture
async def client() -> AsyncIterator[Client]:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(BIN / "temporal"),
        data_converter=pydantic_data_converter,
        port=free_port(),
        ui=False,
    )
    try:
        await ensure_search_attributes(env.client)
        yield env.client
    finally:
        await env.shutdown()


async def probations(client: Client, workflow_id: str) -> int:
    """How many probations the machine's workflow began: timers started after its lease timed out."""
    events = [e.event_type async for e in client.get_workflow_handle(workflow_id).fetch_history_events()]
    timed_out = EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT
    return sum(1 for i, e in enumerate(events) if e == EventType.EVENT_TYPE_TIMER_STARTED and timed_out in events[:i])


async def until_probation(client: Client, workflow_id: str, count: int) -> None:
    for _ in range(150):
        if await probations(client, workflow_id) >= count:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"probation {count} did not begin after the lease expired late")


async def test_a_lease_that_expired_late_waits_for_its_agent_and_a_machine_whose_agent_registers_is_never_lost(
    client: Client,
) -> None:
    name = unique("m")
    machine = LateMachine(name)
    inventory = NodeInventory(name=name, cpus=8, memory_bytes=2**34)
    async with machine_workflow(client, machine, inventory, Settings(node_lease_ttl_seconds=1)) as handle:
        await asyncio.sleep(1)  # its lease renewed, saying when
        machine.alive = False  # Temporal, say, was away: its lease expires, late
        await until_probation(client, handle.id, 1)
        machine.alive = True  # its agent is heard again, and registers within the probation (10 s)
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory))
        await asyncio.sleep(11)  # past the probation
        view = await handle.query(NodeWorkflow.view)
        # never Down: its second registration is the one entry more, and no run was told of a loss
        assert [(e.state, e.reason) for e in view.history] == [("Ready", "Registered by its agent")] * 2
        assert (view.state, machine.lost) == ("Ready", [])

        machine.alive = False  # now its agent stays away: lost once the probation is over
        await until_probation(client, handle.id, 2)
        for _ in range(150):
            view = await handle.query(NodeWorkflow.view)
            if view.state == "Down" and machine.lost:
                break
            await asyncio.sleep(0.1)
        assert [(e.state, e.reason) for e in view.history] == [
            ("Ready", "Registered by its agent"),
            ("Ready", "Registered by its agent"),
            ("Down", "Machine lost: its lease expired"),
        ]
        assert [lost.node for lost in machine.lost] == [name]
        await handle.terminate()
