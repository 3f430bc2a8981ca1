"""The node network's mesh, pure: WireGuard tunnels between machines, so that a worker on one machine's subnet
reaches a worker on another's.

Each machine in the mesh (its agent started with `--mesh-endpoint`) keeps a private key of its own and registers its
public key and endpoint with the control plane beside its subnet (the subnets workflow). The control plane hands each
machine its peers: every other machine with a subnet and a key (`peers_of`). The machine's agent then compares what
its WireGuard interface holds with what it should (`plan_mesh`) and carries out the plan: peers set or removed,
routes to the peers' subnets through the interface added or removed.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

# Linux interface names have at most 15 characters; wireguard-go's control sockets (/var/run/wireguard/<name>.sock)
# are shared by every network namespace, so each machine's interface has a name of its own.
INTERFACE_PREFIX = "astm"


class MeshMember(BaseModel):
    """What a machine in the mesh tells the control plane: its WireGuard public key and where other machines reach
    it (HOST:PORT, UDP). Its private key never leaves the machine."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    public_key: str
    endpoint: str


class MeshPeer(BaseModel):
    """Another machine of the mesh, as one machine sees it: its key, its endpoint and its subnet (the traffic its
    tunnel carries)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str
    public_key: str
    endpoint: str
    subnet: str


@dataclass(frozen=True)
class PeerSeen:
    """A peer as the machine's WireGuard interface holds it now."""

    endpoint: str | None
    allowed: tuple[str, ...]


@dataclass(frozen=True)
class MeshPlan:
    """What to change on a machine's interface: peers to set (new, or changed), peers to remove (by public key),
    routes (subnets through the interface) to add and to remove."""

    set_peers: list[MeshPeer] = field(default_factory=list)
    remove_peers: list[str] = field(default_factory=list)
    add_routes: list[str] = field(default_factory=list)
    remove_routes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.set_peers or self.remove_peers or self.add_routes or self.remove_routes)


def interface_name(node: str) -> str:
    """The machine's WireGuard interface: a name of 14 characters taken from the machine's name."""
    return INTERFACE_PREFIX + hashlib.sha256(node.encode()).hexdigest()[:10]


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is not HOST:PORT (a port of 1 to 65535; an IPv6 address in brackets), or None."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host:
        return f"{endpoint} is not HOST:PORT"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{endpoint}: the port must be a number from 1 to 65535"
    if host.startswith("["):
        if not host.endswith("]"):
            return f"{endpoint}: an IPv6 address goes in brackets, [ADDRESS]:PORT"
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"{endpoint}: {host[1:-1]} is not an IPv6 address"
    elif ":" in host:
        return f"{endpoint}: an IPv6 address goes in brackets, [ADDRESS]:PORT"
    return None


def endpoint_port(endpoint: str) -> int:
    """The port of a HOST:PORT endpoint (checked by `endpoint_problem`): where the machine listens."""
    return int(endpoint.rpartition(":")[2])


def peers_of(node: str, subnets: Mapping[str, str], members: Mapping[str, MeshMember]) -> list[MeshPeer]:
    """The peers of `node`: every other machine that has both a subnet and a place in the mesh, by name."""
    return [
        MeshPeer(node=name, public_key=member.public_key, endpoint=member.endpoint, subnet=subnets[name])
        for name, member in sorted(members.items())
        if name != node and name in subnets
    ]


def plan_mesh(seen: Mapping[str, PeerSeen], routes: Iterable[str], wanted: Iterable[MeshPeer]) -> MeshPlan:
    """What to change so that the interface holds exactly the `wanted` peers (each allowed its subnet, at its
    endpoint) and routes exactly their subnets, given the peers (`seen`, by public key) and routes it has now. A peer
    whose endpoint was learnt from its traffic (WireGuard follows a roaming peer) is left at it while the control
    plane names the same endpoint; a changed one is set again."""
    wanted = sorted(wanted, key=lambda peer: peer.node)
    keys = {peer.public_key for peer in wanted}
    set_peers = [
        peer
        for peer in wanted
        if (now := seen.get(peer.public_key)) is None
        or now.allowed != (_network(peer.subnet),)
        or (now.endpoint is not None and not _same_endpoint(now.endpoint, peer.endpoint))
    ]
    subnets = {_network(peer.subnet) for peer in wanted}
    have = {_network(route) for route in routes}
    return MeshPlan(
        set_peers=set_peers,
        remove_peers=sorted(key for key in seen if key not in keys),
        add_routes=sorted(subnets - have),
        remove_routes=sorted(have - subnets),
    )


@dataclass(frozen=True)
class FirewallRule:
    """One iptables rule: its table, its chain, and what it matches and does."""

    table: str
    chain: str
    spec: tuple[str, ...]


def forward_rules(bridge: str, interface: str, subnet: str) -> list[FirewallRule]:
    """What lets the mesh's traffic through a machine whose engine keeps a firewall (Docker's): forwarded between the
    node network's bridge and the WireGuard interface both ways (Docker's FORWARD chain drops what enters a bridge
    unasked, and its policy is DROP), and never masqueraded on its way into the tunnel (Docker masquerades what leaves
    the bridge's subnet; the peer allows only the subnet's own addresses). Each is put first in its chain."""
    mark = ("-m", "comment", "--comment", f"astraeus mesh {interface}")
    return [
        FirewallRule("filter", "FORWARD", ("-i", interface, "-o", bridge, *mark, "-j", "ACCEPT")),
        FirewallRule("filter", "FORWARD", ("-i", bridge, "-o", interface, *mark, "-j", "ACCEPT")),
        FirewallRule("nat", "POSTROUTING", ("-s", _network(subnet), "-o", interface, *mark, "-j", "RETURN")),
    ]


def _network(text: str) -> str:
    return str(ipaddress.ip_network(text, strict=False))


def _same_endpoint(seen: str, named: str) -> bool:
    """Whether the endpoint the interface holds is the one named (a host name is resolved by WireGuard, so an
    address held for a named host counts as the same)."""
    host = named.rpartition(":")[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return seen.rpartition(":")[2] == named.rpartition(":")[2]
    return seen == named
