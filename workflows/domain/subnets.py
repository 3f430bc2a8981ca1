"""The node network's subnets, pure: each machine gets one subnet of the cluster's range (settings
`node_subnet_range`, split into `/node_subnet_prefix` subnets), never two machines the same, until it is removed.

The subnets workflow (`workflows/subnets.py`) keeps the assignments durably and asks these functions what to give.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Mapping

Network = ipaddress.IPv4Network


def range_problem(cluster_range: str, prefix: int) -> str | None:
    """Why `cluster_range` split into /`prefix` subnets cannot give machines subnets, or None."""
    try:
        network = ipaddress.ip_network(cluster_range)
    except ValueError as err:
        return f"node_subnet_range {cluster_range} is not a network: {err}"
    if not isinstance(network, ipaddress.IPv4Network):
        return f"node_subnet_range {cluster_range} is not an IPv4 network"
    if not network.prefixlen <= prefix <= 30:
        return f"node_subnet_prefix {prefix} must be between the range's own ({network.prefixlen}) and 30"
    return None


def subnets_of(cluster_range: str, prefix: int) -> list[Network]:
    """Every subnet the range holds, in order."""
    network = ipaddress.ip_network(cluster_range)
    assert isinstance(network, ipaddress.IPv4Network)
    return list(network.subnets(new_prefix=prefix))


def assign(assigned: Mapping[str, str], node: str, cluster_range: str, prefix: int) -> str | None:
    """The subnet of `node`: the one it holds while it is still of the range (a restarted agent keeps its subnet),
    else the first subnet no other machine holds; None when every subnet is held."""
    held = assigned.get(node)
    if held is not None and _of_range(held, cluster_range, prefix):
        return held
    taken = {ipaddress.ip_network(subnet) for name, subnet in assigned.items() if name != node}
    for subnet in subnets_of(cluster_range, prefix):
        if not any(subnet.overlaps(other) for other in taken):
            return str(subnet)
    return None


def exhausted(cluster_range: str, prefix: int, holders: int) -> str:
    """Why a machine gets no subnet: every one is held."""
    count = 2 ** (prefix - ipaddress.ip_network(cluster_range).prefixlen)
    return f"every /{prefix} of {cluster_range} is assigned ({holders} machines hold the {count} it has)"


def gateway(subnet: str) -> str:
    """The machine's own address on its subnet (its first host): the gateway of its workers."""
    return str(next(ipaddress.ip_network(subnet).hosts()))


def highest_free(subnet: str, taken: Collection[str]) -> str | None:
    """An address for a worker to start on later (a gang member at its barrier): the subnet's highest host that is
    not its gateway nor `taken` (workers on it, addresses held for others); the engine gives the lowest free ones to
    the workers it places itself, so the two meet last. None when every one is taken."""
    used = {gateway(subnet), *taken}
    return next((str(h) for h in reversed(list(ipaddress.ip_network(subnet).hosts())) if str(h) not in used), None)


def _of_range(subnet: str, cluster_range: str, prefix: int) -> bool:
    network = ipaddress.ip_network(subnet)
    return network.prefixlen == prefix and network.subnet_of(ipaddress.ip_network(cluster_range))  # type: ignore[arg-type]
