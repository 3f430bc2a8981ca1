"""The node network's subnets: each machine one subnet of the range, never two machines the same."""

from __future__ import annotations

import pytest

from workflows.domain.settings import Settings
from workflows.domain.subnets import assign, exhausted, gateway, highest_free, range_problem

RANGE = "10.200.0.0/16"


def test_a_new_machine_gets_the_first_free_subnet() -> None:
    assert assign({}, "m1", RANGE, 24) == "10.200.0.0/24"
    assert assign({"m1": "10.200.0.0/24"}, "m2", RANGE, 24) == "10.200.1.0/24"


def test_a_machine_keeps_its_subnet_when_it_asks_again() -> None:
    assert assign({"m1": "10.200.0.0/24", "m2": "10.200.1.0/24"}, "m2", RANGE, 24) == "10.200.1.0/24"


def test_a_freed_subnet_is_given_again() -> None:
    assert assign({"m2": "10.200.1.0/24"}, "m3", RANGE, 24) == "10.200.0.0/24"


def test_no_two_machines_share_a_subnet_however_many_ask() -> None:
    assigned: dict[str, str] = {}
    for index in range(256):
        subnet = assign(assigned, f"m{index}", RANGE, 24)
        assert subnet is not None
        assigned[f"m{index}"] = subnet
    assert len(set(assigned.values())) == 256
    assert assign(assigned, "m256", RANGE, 24) is None
    assert (
        exhausted(RANGE, 24, len(assigned))
        == "every /24 of 10.200.0.0/16 is assigned (256 machines hold the 256 it has)"
    )


def test_a_subnet_outside_a_changed_range_is_replaced_and_overlaps_are_avoided() -> None:
    assert assign({"m1": "10.100.0.0/24"}, "m1", RANGE, 24) == "10.200.0.0/24"
    # m1 still holds a /23 of the range (a range re-split): m2 gets none that overlaps it.
    assert assign({"m1": "10.200.0.0/23"}, "m2", RANGE, 24) == "10.200.2.0/24"


def test_the_machines_gateway_is_its_subnets_first_address() -> None:
    assert gateway("10.200.7.0/24") == "10.200.7.1"


@pytest.mark.parametrize(
    ("cluster_range", "prefix", "problem"),
    [
        pytest.param(RANGE, 24, None, id="the default"),
        pytest.param("10.200.0.0/33", 24, "node_subnet_range 10.200.0.0/33 is not a network: ", id="not a network"),
        pytest.param("fd00::/64", 80, "node_subnet_range fd00::/64 is not an IPv4 network", id="IPv6"),
        pytest.param(
            RANGE, 12, "node_subnet_prefix 12 must be between the range's own (16) and 30", id="wider than the range"
        ),
    ],
)
def test_a_range_that_cannot_be_split_is_refused(cluster_range: str, prefix: int, problem: str | None) -> None:
    found = range_problem(cluster_range, prefix)
    assert found == problem or (problem is not None and found is not None and found.startswith(problem))


def test_the_settings_default_to_a_24_per_machine_of_10_200_and_refuse_a_bad_range() -> None:
    assert (Settings().node_subnet_range, Settings().node_subnet_prefix) == ("10.200.0.0/16", 24)
    with pytest.raises(ValueError, match="node_subnet_prefix 12 must be between the range's own"):
        Settings(node_subnet_prefix=12)


def test_an_address_held_for_later_is_the_highest_not_taken_nor_the_gateway() -> None:
    assert highest_free("10.203.0.0/29", []) == "10.203.0.6"  # hosts .1 (the gateway) to .6
    assert highest_free("10.203.0.0/29", ["10.203.0.6", "10.203.0.5"]) == "10.203.0.4"
    assert highest_free("10.203.0.0/30", ["10.203.0.2"]) is None  # .1 is the gateway, .2 taken: none left
