"""NodeWorkflow: the lease carries its workers' liveness (workflows/domain/machine/liveness.py). Late by the stale
grace, its runs hear it (their running workers there go Stale); taken again, they hear it back; unrenewed for its TTL,
the machine is lost; taken by a new agent, they hear it (their watches there are attached again)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import FakeMachine, machine_workflow, unique
from workflows.domain.inventory import NodeInventory
from workflows.domain.machine.decisions import Registered
from workflows.domain.settings import Settings
from workflows.node import NodeWorkflow

LATE = Settings(stale_grace_seconds=1, node_lease_ttl_seconds=3)


async def until(check: Callable[[], bool], seconds: float = 10) -> None:
    for _ in range(int(seconds / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("never true")


def machine() -> tuple[FakeMachine, NodeInventory]:
    """A machine's agent and scheduler side (hearing that machine only), and its inventory."""
    node = NodeInventory(name=unique("m"), cpus=8, memory_bytes=2**34)
    return FakeMachine(node.name), node


async def test_a_lease_late_by_the_grace_is_told_then_the_machine_is_lost_at_its_ttl(
    time_skipping: WorkflowEnvironment,
) -> None:
    agent, node = machine()
    async with machine_workflow(time_skipping.client, agent, node, LATE) as handle:
        agent.alive = False
        await until(lambda: agent.told == ["late", "lost"])
        view = await handle.query(NodeWorkflow.view)
        late, lost = agent.heard[0], agent.lost[0]
        assert late.at < view.history[-1].at
        assert lost.lost_at is not None and 1.5 <= (lost.lost_at - late.at).total_seconds() <= 2.5  # 3 - 1 s after
        assert [(e.state, e.reason) for e in view.history] == [
            ("Ready", "Registered by its agent"),
            ("Down", "Machine lost: its lease expired"),
        ]
        await handle.terminate()


async def test_a_late_lease_taken_again_within_its_ttl_is_heard_back_and_the_machine_never_lost(
    time_skipping: WorkflowEnvironment,
) -> None:
    agent, node = machine()
    async with machine_workflow(time_skipping.client, agent, node, LATE) as handle:
        agent.alive = False
        await until(lambda: agent.told == ["late"])
        agent.alive = True
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=node))  # its agent, heard again
        await until(lambda: agent.told == ["late", "back"])
        await asyncio.sleep(3)  # a TTL more: the lease taken again holds
        view = await handle.query(NodeWorkflow.view)
        assert agent.told == ["late", "back"]
        assert [e.state for e in view.history] == ["Ready", "Ready"]
        await handle.terminate()


async def test_the_same_agent_again_and_a_new_agent_taking_the_machine_over_are_told_to_its_runs(
    time_skipping: WorkflowEnvironment,
) -> None:
    agent, node = machine()
    async with machine_workflow(time_skipping.client, agent, node, LATE) as handle:
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=node, instance="host:1:a"))
        await asyncio.sleep(0.5)
        assert agent.told == []  # its first known agent: nothing to tell
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=node, instance="host:1:a"))  # again
        await until(lambda: agent.told == ["back"])  # its lease had timed out: its runs attach their watches again
        taken = Registered(inventory=node, instance="host:2:b", take_over="host:1:a")
        await handle.execute_update(NodeWorkflow.register, taken)
        await until(lambda: agent.told == ["back", "new agent"])
        assert agent.heard[1].node == node.name and not agent.heard[1].late
        await handle.terminate()
