"""SubnetsWorkflow (id `subnets`): the node network's subnets, durable. Each machine's agent asks for its machine's
subnet (`assign_subnet`) and gets the one it holds, else the first free one of the control plane's range (settings
`node_subnet_range`, `node_subnet_prefix`, read from the control plane, so every machine is given subnets of one
range); removing the machine frees it (`free_subnet`). Never two machines the same subnet: the assignments live in
this one workflow's state, carried over when it continues as new.

The mesh: an agent that joins it sends its WireGuard public key and endpoint with its request (never its private key),
and asks for its peers (`mesh_peers`: every other machine with a subnet and a key) at each look."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import CONTROL_TASK_QUEUE
    from workflows.domain.mesh import MeshMember, MeshPeer, peers_of
    from workflows.domain.subnets import assign, exhausted
    from workflows.messages import LoadSettingsResult, MeshPeersRequest, NodeSubnet, SubnetRequest, SubnetsInput


@workflow.defn(name=contracts.SUBNETS_WORKFLOW)
class SubnetsWorkflow:
    @workflow.init
    def __init__(self, input: SubnetsInput) -> None:
        self._assigned: dict[str, str] = dict(input.assigned)
        self._mesh: dict[str, MeshMember] = dict(input.mesh)
        # One assignment at a time: between reading the range and taking a subnet, no other machine takes one.
        self._lock = asyncio.Lock()

    @workflow.run
    async def run(self, input: SubnetsInput) -> None:
        await workflow.wait_condition(lambda: workflow.info().is_continue_as_new_suggested())
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(SubnetsInput(assigned=dict(self._assigned), mesh=dict(self._mesh)))

    def _list(self) -> list[NodeSubnet]:
        return [NodeSubnet(node=node, subnet=self._assigned[node]) for node in sorted(self._assigned)]

    @workflow.update(name=contracts.ASSIGN_SUBNET.name)
    async def assign_subnet(self, request: SubnetRequest) -> NodeSubnet:
        async with self._lock:
            loaded: LoadSettingsResult = await workflow.execute_activity(
                contracts.load_settings,
                task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=10),
                retry_policy=contracts.PATIENT,
                summary="the node network's range",
            )
            cluster_range, prefix = loaded.settings.node_subnet_range, loaded.settings.node_subnet_prefix
            subnet = assign(self._assigned, request.node, cluster_range, prefix)
            if subnet is None:
                return NodeSubnet(node=request.node, why=exhausted(cluster_range, prefix, len(self._assigned)))
            self._assigned[request.node] = subnet
            if request.mesh is None:
                self._mesh.pop(request.node, None)
            else:
                self._mesh[request.node] = request.mesh
            return NodeSubnet(node=request.node, subnet=subnet)

    @workflow.update(name=contracts.FREE_SUBNET.name)
    async def free_subnet(self, request: SubnetRequest) -> list[NodeSubnet]:
        async with self._lock:
            self._assigned.pop(request.node, None)
            self._mesh.pop(request.node, None)
            return self._list()

    @workflow.query(name=contracts.SUBNETS.name)
    def subnets(self) -> list[NodeSubnet]:
        return self._list()

    @workflow.query(name=contracts.MESH_PEERS.name)
    def mesh_peers(self, request: MeshPeersRequest) -> list[MeshPeer]:
        return peers_of(request.node, self._assigned, self._mesh)
