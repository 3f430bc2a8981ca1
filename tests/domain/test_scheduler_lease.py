"""The scheduler's lease, pure: who may claim it, what each grant's epoch is, and what expiry leaves."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from workflows.domain.scheduling.lease import (
    ClaimLease,
    LeaseRefusal,
    SchedulerLease,
    check_claim,
    decide_claim,
    decide_expired,
    standby_message,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
T1 = datetime(2026, 1, 1, 0, 1, tzinfo=UTC)
FREE = SchedulerLease()
HELD = SchedulerLease(holder="a:1:x", epoch=3, since=T0)
LAPSED = SchedulerLease(holder=None, epoch=3, since=T0)


@pytest.mark.parametrize(
    ("lease", "claim", "refused"),
    [
        pytest.param(FREE, ClaimLease(instance="a:1:x"), None, id="a fresh cluster's first claim is granted"),
        pytest.param(LAPSED, ClaimLease(instance="b:2:y"), None, id="a lease that expired goes to the next claimant"),
        pytest.param(HELD, ClaimLease(instance="a:1:x"), None, id="its holder may claim it again"),
        pytest.param(
            HELD,
            ClaimLease(instance="b:2:y", take_over="a:1:x"),
            None,
            id="a claimant that found the holder gone takes it over",
        ),
        pytest.param(
            HELD,
            ClaimLease(instance="b:2:y"),
            LeaseRefusal(
                message="standby: scheduler a:1:x holds the lease (epoch 3)",
                type="LeaseHeld",
                details=("a:1:x", "3"),
            ),
            id="a second scheduler is refused while the lease lives, naming the holder and its epoch",
        ),
        pytest.param(
            HELD,
            ClaimLease(instance="b:2:y", take_over="c:3:z"),
            LeaseRefusal(
                message="standby: scheduler a:1:x holds the lease (epoch 3)",
                type="LeaseHeld",
                details=("a:1:x", "3"),
            ),
            id="taking over another holder than the one that holds it is refused",
        ),
    ],
)
def test_who_may_claim_the_lease(lease: SchedulerLease, claim: ClaimLease, refused: LeaseRefusal | None) -> None:
    assert check_claim(lease, claim) == refused


@pytest.mark.parametrize(
    ("lease", "claim", "after"),
    [
        pytest.param(
            FREE,
            ClaimLease(instance="a:1:x", ttl_seconds=2),
            SchedulerLease(holder="a:1:x", epoch=1, since=T1, ttl_seconds=2),
            id="the first grant is epoch 1, with its holder's TTL",
        ),
        pytest.param(
            LAPSED,
            ClaimLease(instance="b:2:y"),
            SchedulerLease(holder="b:2:y", epoch=4, since=T1),
            id="a new holder after expiry gets the next epoch",
        ),
        pytest.param(
            HELD,
            ClaimLease(instance="a:1:x"),
            SchedulerLease(holder="a:1:x", epoch=4, since=T1),
            id="its holder claiming again begins a new term (it rebuilds its view)",
        ),
        pytest.param(
            HELD,
            ClaimLease(instance="b:2:y", take_over="a:1:x"),
            SchedulerLease(holder="b:2:y", epoch=4, since=T1),
            id="a takeover gets the next epoch",
        ),
    ],
)
def test_each_grant_has_the_next_epoch(lease: SchedulerLease, claim: ClaimLease, after: SchedulerLease) -> None:
    assert decide_claim(lease, claim, T1) == after


def test_an_expired_lease_is_no_ones_and_keeps_its_epoch() -> None:
    assert decide_expired(HELD, T1) == SchedulerLease(holder=None, epoch=3, since=T1)
    granted = decide_claim(decide_expired(HELD, T1), ClaimLease(instance="b:2:y"), T1)
    assert (granted.holder, granted.epoch) == ("b:2:y", 4)


def test_epochs_only_grow_over_any_sequence_of_claims_and_expiries() -> None:
    lease, epochs = FREE, []
    for step, who in enumerate(["a", "a", None, "b", None, "a", "b"]):
        if who is None:
            lease = decide_expired(lease, T1)
        elif check_claim(lease, ClaimLease(instance=who)) is None:
            lease = decide_claim(lease, ClaimLease(instance=who), T1)
        epochs.append(lease.epoch)
        assert step == 0 or epochs[-1] >= epochs[-2]
    assert epochs == [1, 2, 2, 3, 3, 4, 4]
    assert lease.holder == "a"


def test_the_standby_message_names_the_holder_and_its_epoch() -> None:
    assert standby_message("h:9:t", 7) == "standby: scheduler h:9:t holds the lease (epoch 7)"


def test_a_claim_without_an_instance_is_invalid() -> None:
    with pytest.raises(ValueError):
        ClaimLease(instance="")
