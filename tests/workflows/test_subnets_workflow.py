"""SubnetsWorkflow: machines get subnets of the control plane's range, never two the same; a machine that asks
again keeps its own; a freed subnet is given again; machines in the mesh are handed each other as peers; what it
holds goes on when it continues as new."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from temporalio import activity
from temporalio.client import WorkflowHandle
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fakes import unique
from workflows import contracts
from workflows.contracts import CONTROL_TASK_QUEUE
from workflows.domain.mesh import MeshMember, MeshPeer
from workflows.domain.settings import Settings
from workflows.messages import LoadSettingsResult, MeshPeersRequest, NodeSubnet, SubnetRequest, SubnetsInput
from workflows.subnets import SubnetsWorkflow

# Two /24s: the third machine gets none until one is freed.
SETTINGS = Settings(node_subnet_range="10.9.0.0/23", node_subnet_prefix=24)


@activity.defn(name="load_settings")
async def load_settings() -> LoadSettingsResult:
    return LoadSettingsResult(settings=SETTINGS, protocol=1)


@asynccontextmanager
async def subnets(env: WorkflowEnvironment, held: SubnetsInput | None = None) -> AsyncIterator[WorkflowHandle]:
    """A subnets workflow (holding `held`, as continue-as-new hands it on) and a worker serving it."""
    client = env.client
    async with Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[SubnetsWorkflow], activities=[load_settings]):
        yield await client.start_workflow(
            contracts.SUBNETS_WORKFLOW, held or SubnetsInput(), id=unique("subnets"), task_queue=CONTROL_TASK_QUEUE
        )


async def test_machines_get_subnets_never_twice_and_a_freed_one_is_given_again(
    time_skipping: WorkflowEnvironment,
) -> None:
    async with subnets(time_skipping) as handle:

        async def ask(node: str) -> NodeSubnet:
            return await contracts.update(handle, contracts.ASSIGN_SUBNET, SubnetRequest(node=node))

        assert await ask("m1") == NodeSubnet(node="m1", subnet="10.9.0.0/24")
        assert await ask("m2") == NodeSubnet(node="m2", subnet="10.9.1.0/24")
        assert await ask("m1") == NodeSubnet(node="m1", subnet="10.9.0.0/24")  # its agent restarted
        why = "every /24 of 10.9.0.0/23 is assigned (2 machines hold the 2 it has)"
        assert await ask("m3") == NodeSubnet(node="m3", why=why)

        freed = await contracts.update(handle, contracts.FREE_SUBNET, SubnetRequest(node="m1"))
        assert freed == [NodeSubnet(node="m2", subnet="10.9.1.0/24")]
        assert await ask("m3") == NodeSubnet(node="m3", subnet="10.9.0.0/24")
        assert await contracts.query(handle, contracts.SUBNETS) == [
            NodeSubnet(node="m2", subnet="10.9.1.0/24"),
            NodeSubnet(node="m3", subnet="10.9.0.0/24"),
        ]


async def test_a_workflow_continued_with_the_subnets_it_held_keeps_them_held(
    time_skipping: WorkflowEnvironment,
) -> None:
    held = SubnetsInput(assigned={"m1": "10.9.1.0/24"})  # what continue-as-new hands the next run
    async with subnets(time_skipping, held) as handle:
        taken = await contracts.update(handle, contracts.ASSIGN_SUBNET, SubnetRequest(node="m2"))
        assert taken == NodeSubnet(node="m2", subnet="10.9.0.0/24")
        assert await contracts.update(handle, contracts.ASSIGN_SUBNET, SubnetRequest(node="m1")) == NodeSubnet(
            node="m1", subnet="10.9.1.0/24"
        )


async def test_machines_in_the_mesh_are_each_others_peers_until_one_leaves_it_or_is_removed(
    time_skipping: WorkflowEnvironment,
) -> None:
    async with subnets(time_skipping) as handle:
        m1, m2 = MeshMember(public_key="K1=", endpoint="192.0.2.1:51820"), MeshMember(public_key="K2=", endpoint="h:1")

        async def peers(node: str) -> list[MeshPeer]:
            return await contracts.query(handle, contracts.MESH_PEERS, MeshPeersRequest(node=node))

        await contracts.update(handle, contracts.ASSIGN_SUBNET, SubnetRequest(node="m1", mesh=m1))
        assert await peers("m1") == []
        await contracts.update(handle, contracts.ASSIGN_SUBNET, SubnetRequest(node="m2", mesh=m2))
        assert await peers("m1") == [MeshPeer(node="m2", public_key="K2=", endpoint="h:1", subnet="10.9.1.0/24")]
        assert await peers("m2") == [
            MeshPeer(node="m1", public_key="K1=", endpoint="192.0.2.1:51820", subnet="10.9.0.0/24")
        ]
        # m2's agent restarts without --mesh-endpoint: it keeps its subnet and leaves the mesh.
        await contracts.update(handle, contracts.ASSIGN_SUBNET, SubnetRequest(node="m2"))
        assert await peers("m1") == []
        await contracts.update(handle, contracts.ASSIGN_SUBNET, SubnetRequest(node="m2", mesh=m2))
        await contracts.update(handle, contracts.FREE_SUBNET, SubnetRequest(node="m1"))  # m1 is removed
        assert await peers("m2") == []
        assert await contracts.query(handle, contracts.SUBNETS) == [NodeSubnet(node="m2", subnet="10.9.1.0/24")]


async def test_a_workflow_continued_with_the_mesh_keeps_its_members(time_skipping: WorkflowEnvironment) -> None:
    member = MeshMember(public_key="K1=", endpoint="192.0.2.1:51820")
    held = SubnetsInput(assigned={"m1": "10.9.1.0/24"}, mesh={"m1": member})
    async with subnets(time_skipping, held) as handle:
        assert await contracts.query(handle, contracts.MESH_PEERS, MeshPeersRequest(node="m2")) == [
            MeshPeer(node="m1", public_key="K1=", endpoint="192.0.2.1:51820", subnet="10.9.1.0/24")
        ]
