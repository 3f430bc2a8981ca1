"""The node network's mesh, pure: each machine's peers, what to change on its WireGuard interface, its endpoint and
its interface's name, and the firewall rules that let the mesh's traffic through Docker's."""

from __future__ import annotations

import pytest

from workflows.domain.mesh import (
    FirewallRule,
    MeshMember,
    MeshPeer,
    MeshPlan,
    PeerSeen,
    endpoint_port,
    endpoint_problem,
    forward_rules,
    interface_name,
    peers_of,
    plan_mesh,
)

SUBNETS = {"a": "10.9.0.0/24", "b": "10.9.1.0/24", "c": "10.9.2.0/24"}
A = MeshMember(public_key="KA=", endpoint="192.0.2.1:51820")
B = MeshMember(public_key="KB=", endpoint="192.0.2.2:51820")
PEER_B = MeshPeer(node="b", public_key="KB=", endpoint="192.0.2.2:51820", subnet="10.9.1.0/24")


def test_a_machines_peers_are_the_other_machines_with_a_subnet_and_a_key() -> None:
    # c has a subnet and no key (its agent joins no mesh); d a key and no subnet (removed meanwhile).
    members = {"a": A, "b": B, "d": MeshMember(public_key="KD=", endpoint="192.0.2.4:1")}
    assert peers_of("a", SUBNETS, members) == [PEER_B]
    assert peers_of("c", SUBNETS, members) == [
        MeshPeer(node="a", public_key="KA=", endpoint="192.0.2.1:51820", subnet="10.9.0.0/24"),
        PEER_B,
    ]


def test_a_new_peer_is_set_and_routed() -> None:
    assert plan_mesh({}, [], [PEER_B]) == MeshPlan(set_peers=[PEER_B], add_routes=["10.9.1.0/24"])


def test_an_interface_that_holds_what_it_should_is_left_alone() -> None:
    seen = {"KB=": PeerSeen(endpoint="192.0.2.2:51820", allowed=("10.9.1.0/24",))}
    assert plan_mesh(seen, ["10.9.1.0/24"], [PEER_B]).empty


def test_a_peer_not_heard_from_yet_has_no_endpoint_learnt_and_is_left_alone() -> None:
    seen = {"KB=": PeerSeen(endpoint=None, allowed=("10.9.1.0/24",))}
    assert plan_mesh(seen, ["10.9.1.0/24"], [PEER_B]).empty


@pytest.mark.parametrize(
    "seen",
    [
        PeerSeen(endpoint="192.0.2.9:51820", allowed=("10.9.1.0/24",)),
        PeerSeen(endpoint="192.0.2.2:51820", allowed=("10.9.7.0/24",)),
        PeerSeen(endpoint="192.0.2.2:51820", allowed=()),
    ],
    ids=["a peer that moved is set again", "a peer given another subnet is set again", "a peer allowed nothing"],
)
def test_a_changed_peer_is_set_again(seen: PeerSeen) -> None:
    assert plan_mesh({"KB=": seen}, ["10.9.1.0/24"], [PEER_B]) == MeshPlan(set_peers=[PEER_B])


def test_a_peer_named_by_host_name_is_the_same_at_any_address_on_its_port() -> None:
    named = PEER_B.model_copy(update={"endpoint": "machine-b.example:51820"})
    seen = {"KB=": PeerSeen(endpoint="192.0.2.2:51820", allowed=("10.9.1.0/24",))}
    assert plan_mesh(seen, ["10.9.1.0/24"], [named]).empty
    assert plan_mesh(seen, ["10.9.1.0/24"], [named.model_copy(update={"endpoint": "machine-b.example:1"})]) == (
        MeshPlan(set_peers=[named.model_copy(update={"endpoint": "machine-b.example:1"})])
    )


def test_a_peer_gone_is_removed_with_its_route() -> None:
    seen = {"KB=": PeerSeen(endpoint="192.0.2.2:51820", allowed=("10.9.1.0/24",))}
    assert plan_mesh(seen, ["10.9.1.0/24"], []) == MeshPlan(remove_peers=["KB="], remove_routes=["10.9.1.0/24"])


def test_a_machine_that_changed_its_key_is_set_anew_and_its_old_key_removed() -> None:
    seen = {"OLD=": PeerSeen(endpoint="192.0.2.2:51820", allowed=("10.9.1.0/24",))}
    assert plan_mesh(seen, ["10.9.1.0/24"], [PEER_B]) == MeshPlan(set_peers=[PEER_B], remove_peers=["OLD="])


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("192.0.2.1:51820", None),
        ("machine-b.example:51820", None),
        ("[2001:db8::1]:51820", None),
        ("192.0.2.1", "192.0.2.1 is not HOST:PORT"),
        (":51820", ":51820 is not HOST:PORT"),
        ("192.0.2.1:0", "192.0.2.1:0: the port must be a number from 1 to 65535"),
        ("192.0.2.1:udp", "192.0.2.1:udp: the port must be a number from 1 to 65535"),
        ("2001:db8::1:51820", "2001:db8::1:51820: an IPv6 address goes in brackets, [ADDRESS]:PORT"),
        ("[nope]:51820", "[nope]:51820: nope is not an IPv6 address"),
    ],
)
def test_an_endpoint_is_host_colon_port(endpoint: str, problem: str | None) -> None:
    assert endpoint_problem(endpoint) == problem


def test_a_machine_listens_on_its_endpoints_port() -> None:
    assert endpoint_port("[2001:db8::1]:51821") == 51821


def test_each_machine_has_an_interface_name_of_its_own_that_linux_accepts() -> None:
    names = {interface_name(f"machine-{index}") for index in range(1000)}
    assert len(names) == 1000
    assert all(len(name) <= 15 and name.startswith("astm") for name in names)
    assert interface_name("a") == interface_name("a")


def test_the_mesh_is_forwarded_both_ways_and_never_masqueraded_into_the_tunnel() -> None:
    mark = ("-m", "comment", "--comment", "astraeus mesh wg0")
    assert forward_rules("br0", "wg0", "10.9.0.1/24") == [
        FirewallRule("filter", "FORWARD", ("-i", "wg0", "-o", "br0", *mark, "-j", "ACCEPT")),
        FirewallRule("filter", "FORWARD", ("-i", "br0", "-o", "wg0", *mark, "-j", "ACCEPT")),
        FirewallRule("nat", "POSTROUTING", ("-s", "10.9.0.0/24", "-o", "wg0", *mark, "-j", "RETURN")),
    ]
