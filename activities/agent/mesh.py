"""This machine's place in the node network's mesh: WireGuard tunnels to every other machine in it, so that its
workers reach workers on other machines' subnets (`--mesh-endpoint HOST:PORT`; without it the machine joins none).

- Its **key**: an X25519 private key of its own, made once and kept in its state directory (mode 0600). Only the
  public key leaves the machine: it goes to the control plane with the machine's request for its subnet.
- **Joining**: once its node network is made, the machine's interface is made (`activities/agent/wireguard.py`), with
  the firewall rules that let the mesh's traffic between the interface and the node network's bridge.
- **Peers**: at each refresh (settings `mesh_refresh_seconds`) the machine asks the control plane for its peers
  (each other machine's key, endpoint and subnet) and sets what changed (`workflows/domain/mesh.py` plans it): a
  machine that joins is reached within one refresh, one removed is dropped within one.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat
from temporalio.client import Client

from activities.agent.wireguard import Link, MeshDown
from workflows import contracts
from workflows.contracts import SUBNETS_WORKFLOW_ID
from workflows.domain.mesh import (
    FirewallRule,
    MeshMember,
    MeshPeer,
    endpoint_port,
    forward_rules,
    interface_name,
    plan_mesh,
)
from workflows.messages import MeshPeersRequest

log = logging.getLogger(__name__)

KEY_FILE = "private.key"


def private_key(path: Path) -> X25519PrivateKey:
    """The machine's key, made the first time (readable by its owner alone: it never leaves the machine)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = X25519PrivateKey.generate().private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
        draft = path.with_suffix(".new")
        draft.unlink(missing_ok=True)
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(base64.b64encode(raw).decode() + "\n")
        draft.replace(path)
    return X25519PrivateKey.from_private_bytes(base64.b64decode(path.read_text().strip()))


def public_key(key: X25519PrivateKey) -> str:
    return base64.b64encode(key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)).decode()


class Mesh:
    """The machine's end of the mesh: its key, its interface, its peers."""

    def __init__(
        self, client: Client, node: str, endpoint: str, netns: str | None, state_dir: Path, refresh_seconds: float
    ) -> None:
        self._client = client
        self._node = node
        self.endpoint = endpoint
        self.interface = interface_name(node)
        self._key_file = state_dir / KEY_FILE
        self.member = MeshMember(public_key=public_key(private_key(self._key_file)), endpoint=endpoint)
        self.link = Link(self.interface, netns, state_dir)
        self._refresh_seconds = refresh_seconds
        self._joined: tuple[str, str] | None = None  # the bridge and subnet its interface and rules serve
        self._rules: list[FirewallRule] = []
        self._refreshed = 0.0  # time.monotonic() of its last refresh

    def join(self, bridge: str, subnet: str) -> None:
        """Make the interface and let the mesh's traffic reach the bridge, unless done for this bridge and subnet.
        Blocking: call it on a thread. Raises MeshDown."""
        if self._joined == (bridge, subnet):
            return
        self.link.up(self._key_file, endpoint_port(self.endpoint))
        rules = forward_rules(bridge, self.interface, subnet)
        self.link.remove_rules([rule for rule in self._rules if rule not in rules])
        self.link.add_rules(rules)
        self._rules, self._joined = rules, (bridge, subnet)
        log.info("%s: in the mesh as %s at %s", self._node, self.interface, self.endpoint)

    def due(self) -> bool:
        return time.monotonic() - self._refreshed >= self._refresh_seconds

    async def refresh(self) -> None:
        """Ask the control plane for the machine's peers and set what changed. Raises MeshDown, or the client's
        error when the control plane does not answer."""
        handle = self._client.get_workflow_handle(SUBNETS_WORKFLOW_ID)
        peers = await contracts.query(handle, contracts.MESH_PEERS, MeshPeersRequest(node=self._node))
        await asyncio.to_thread(self._apply, peers)
        self._refreshed = time.monotonic()

    def _apply(self, peers: list[MeshPeer]) -> None:
        plan = plan_mesh(self.link.peers(), self.link.routes(), peers)
        if not plan.empty:
            self.link.apply(plan)
            added, removed = [p.node for p in plan.set_peers], len(plan.remove_peers)
            log.info("%s: mesh peers set: %s; %d removed", self._node, ", ".join(added) or "none", removed)

    def close(self) -> None:
        """The agent stops: its interface goes (with its wireguard-go and routes), and its rules."""
        try:
            self.link.remove_rules(self._rules)
            self.link.down()
        except MeshDown as err:
            log.warning("%s: the mesh's interface was not all removed: %s", self._node, err)
        self._joined, self._rules = None, []
