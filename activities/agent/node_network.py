"""This machine's part of the node network: its subnet, asked of the control plane (the subnets workflow), and
its network with that subnet, made by its runtime (the docker runtime: a bridge network its workers join).

A machine in the mesh (`activities/agent/mesh.py`) sends its public key and endpoint with its request, and joins the
mesh once its network is made: the node network is up when the machine's peers were set once.

The agent calls `look` at each look of its lease: until the network is up it asks and makes it (`ensure`), then it
refreshes the mesh's peers when that is due; a worker that asks for the mesh waits "Waiting for the node network
(subnet assignment and mesh)" until the network is up. A machine whose runtime has no networks of its own (the
process runtime) cannot host it, and says so in its per-machine reason.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from temporalio.client import Client

from activities.agent.mesh import Mesh
from activities.agent.runtime.base import NetworkNotUp, Runtime
from activities.agent.wireguard import MeshDown
from workflows import contracts
from workflows.contracts import SUBNETS_WORKFLOW_ID
from workflows.domain.refs import TaskRef
from workflows.messages import SubnetRequest, SubnetsInput

log = logging.getLogger(__name__)

PROCESS_NETWORK = (
    "its workers run as processes on the machine's own network; the node network needs the docker runtime, "
    "whose workers join a network with the machine's subnet"
)


@dataclass(frozen=True)
class NodeNetworkUp:
    """The machine's network is up: its name (what workers join) and its subnet."""

    name: str
    subnet: str


def network_missing(runtime: Runtime) -> str | None:
    """Why this machine cannot host the node network, or None."""
    return None if hasattr(runtime, "node_network") else PROCESS_NETWORK


class NodeNetwork:
    def __init__(self, client: Client, node: str, runtime: Runtime, mesh: Mesh | None = None) -> None:
        self._client = client
        self._node = node
        self._runtime = runtime
        self.mesh = mesh
        self.up: NodeNetworkUp | None = None
        self.why = "not asked yet"  # why it is not up, as last seen
        # The subnet the control plane gave since the machine last registered: while its network or its mesh is not
        # up yet, it is not asked again at each look (each ask is an update, an event in the subnets workflow).
        self._subnet: str | None = None

    async def look(self) -> None:
        """Until the network is up, ask for it and make it; then refresh the mesh's peers when that is due."""
        if self.up is None:
            await self.ensure()
        elif self.mesh is not None and self.mesh.due():
            try:
                await self.mesh.refresh()
            except Exception as err:  # the control plane is away, or a peer could not be set: again next time
                self._note(f"the mesh's peers were not set: {err}")

    async def ensure(self) -> NodeNetworkUp | None:
        """Ask for the machine's subnet and make its network, and join the mesh, once; then nothing more to do.
        Failures are kept in `why` and tried again at the next call."""
        if self.up is not None or network_missing(self._runtime) is not None:
            return self.up
        if self._subnet is None:
            try:
                handle = await contracts.singleton(
                    self._client, contracts.SUBNETS_WORKFLOW, SubnetsInput(), SUBNETS_WORKFLOW_ID, "the node network"
                )
                member = self.mesh.member if self.mesh is not None else None
                request = SubnetRequest(node=self._node, mesh=member)
                assigned = await contracts.update(handle, contracts.ASSIGN_SUBNET, request)
            except Exception as err:  # the control plane is away: asked again at the next look
                self._note(f"the control plane did not assign a subnet: {err}")
                return None
            if assigned.subnet is None:
                self._note(f"no subnet: {assigned.why}")
                return None
            self._subnet = assigned.subnet
        subnet = self._subnet
        make = getattr(self._runtime, "node_network")  # noqa: B009 (the docker runtime's, checked above)
        try:
            name = await asyncio.to_thread(make, subnet)
        except NetworkNotUp as err:
            self._note(f"its network with subnet {subnet} is not up: {err}")
            return None
        if self.mesh is not None:
            mesh = self.mesh
            bridge = getattr(self._runtime, "node_bridge")  # noqa: B009 (the docker runtime's, as above)
            try:
                await asyncio.to_thread(lambda: mesh.join(bridge(), subnet))
                await mesh.refresh()
            except (MeshDown, NetworkNotUp) as err:
                self._note(f"it is not in the mesh: {err}")
                return None
            except Exception as err:  # the control plane is away: asked again at the next look
                self._note(f"the mesh's peers were not set: {err}")
                return None
        self.up = NodeNetworkUp(name=name, subnet=subnet)
        log.info("%s: node network %s up with subnet %s", self._node, name, subnet)
        return self.up

    def _note(self, why: str) -> None:
        """Why it is not up; logged when that changes (it is asked again at every look)."""
        if why != self.why:
            log.warning("%s: node network: %s", self._node, why)
        self.why = why

    def forget(self) -> None:
        """The machine registered again (it may have been removed, its subnet freed): ask again."""
        self.up = None
        self._subnet = None

    async def address_of(self, key: TaskRef) -> str | None:
        """A started attempt's address on the node network (the docker runtime's), None without one."""
        of = getattr(self._runtime, "node_address", None)
        return None if of is None else await asyncio.to_thread(of, key)

    def close(self) -> None:
        """The agent stops: the machine leaves the mesh (its interface goes; its network stays for its workers)."""
        if self.mesh is not None:
            self.mesh.close()
