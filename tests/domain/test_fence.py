"""Liveness and fencing (issue 39): how long a lost machine's workers may still run (`fenced_at`), a lease's expiry
that came late (`expired_late`, the cluster was away), and a run that starts a lost worker again elsewhere only once
its copy there has surely stopped."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.domain.test_gang import IDS, gone, of, running_gang
from tests.domain.test_job import at, running_story
from workflows.domain.machine.fence import expired_late, fenced_at, probation
from workflows.domain.run.events import ArmTimer, MachineLost, Place, Release, Stop, Timer, TimerFired
from workflows.domain.settings import Settings

# ---- the machine's side: pure timers ----------------------------------------------------------------------------


def test_a_lost_machines_workers_may_run_until_its_fence_after_its_last_renewal_plus_their_grace_and_the_skew() -> None:
    # The lease (30 s) expired now: Temporal recorded its last renewal 30 s ago at the latest; the agent stops its
    # workers 4 leases (120 s) after that renewal, each within its grace (10 s); clocks may differ by 5 s.
    assert fenced_at(at(100), Settings()) == at(100 - 30 + 120 + 10 + 5)
    shorter = Settings(node_lease_ttl_seconds=3, fence_after_seconds=12, stop_grace_seconds=1, clock_skew_seconds=0)
    assert fenced_at(at(100), shorter) == at(100 - 3 + 12 + 1)


def test_the_fence_defaults_to_four_leases_and_is_never_shorter_than_one() -> None:
    assert (Settings().fence_seconds, Settings(node_lease_ttl_seconds=3).fence_seconds) == (120, 12)
    assert Settings(fence_after_seconds=300).fence_seconds == 300
    with pytest.raises(ValueError, match=r"fence_after_seconds \(10\) is shorter than node_lease_ttl_seconds \(30\)"):
        Settings(fence_after_seconds=10)


LATE = [
    # (id, seconds since the last renewal when the expiry is decided, late?)
    ("an expiry on time: a TTL after the last renewal", 30.5, False),
    ("a TTL, a renewal and the skew after it: still on time", 30 + 10 + 5, False),
    ("later than that: the cluster was away", 30 + 10 + 5.1, True),
    ("after Temporal was away 70 s", 75, True),
]


@pytest.mark.parametrize(("since", "late"), [c[1:] for c in LATE], ids=[c[0] for c in LATE])
def test_an_expiry_is_late_when_it_comes_well_after_a_lease_past_its_last_renewal(since: float, late: bool) -> None:
    assert expired_late(at(100 - since), at(100), Settings()) is late


def test_an_agent_that_sent_no_renewal_time_is_never_late_and_the_probation_is_a_lease_or_10_s() -> None:
    assert expired_late(None, at(100), Settings()) is False
    assert probation(Settings()) == timedelta(seconds=30)
    assert probation(Settings(node_lease_ttl_seconds=3)) == timedelta(seconds=10)  # a client's reconnection at least


# ---- the run's side: a lost worker starts again once its copy has surely stopped --------------------------------


def test_a_worker_lost_with_its_machine_restarts_only_once_the_machines_fence_has_passed_and_says_so() -> None:
    story = running_story(1)
    assert story.step(10, MachineLost(node="n0", lost_at=at(10), fenced_at=at(115))) == [
        Release(task_id="w-0", attempt=0),
        ArmTimer(timer=Timer.RESTART, task_id="w-0", attempt=0, at=at(115)),  # not at 20 s, its back-off
    ]
    assert story.history("w-0")[-2:] == [
        ("Down", "Machine lost: its lease expired"),
        ("Down", "Restarts at 2025-01-01 12:01:55 UTC, once its copy on n0 has surely stopped"),
    ]
    assert story.job.task("w-0").restart_at == at(115)
    story.step(115, TimerFired(timer=Timer.RESTART, task_id="w-0", attempt=0))
    assert story.status("w-0") == ("Pending", "Restarted by policy (restart 1/10)")
    assert story.job.task("w-0").attempt.fenced_until is None  # a new attempt: nothing of the lost one


def test_a_fence_that_passes_within_the_back_off_changes_nothing() -> None:
    story = running_story(1)
    assert story.step(10, MachineLost(node="n0", lost_at=at(10), fenced_at=at(15))) == [
        Release(task_id="w-0", attempt=0),
        ArmTimer(timer=Timer.RESTART, task_id="w-0", attempt=0, at=at(20)),
    ]
    assert story.history("w-0")[-1] == ("Down", "Machine lost: its lease expired")


def test_a_report_without_a_fence_restarts_after_the_back_off_as_before() -> None:
    story = running_story(1)
    story.step(10, MachineLost(node="n0", lost_at=at(10)))
    assert story.job.task("w-0").restart_at == at(20)


def test_a_worker_that_never_restarts_fails_at_once_its_fence_aside() -> None:
    story = running_story(1, policy="Never")
    story.step(10, MachineLost(node="n0", lost_at=at(10), fenced_at=at(115)))
    assert story.status("w-0") == ("Down", "Machine lost: its lease expired")
    assert story.status()[0] == "Failed"


def test_a_gang_whose_member_was_lost_restarts_whole_once_that_members_copy_has_surely_stopped_and_says_so() -> None:
    story = running_gang()  # w-i on n<i>, running since 5 s
    commands = story.step(10, MachineLost(node="n2", lost_at=at(10), fenced_at=at(115)))
    assert [s.task_id for s in of(commands, Stop)] == ["w-0", "w-1", "w-3"]
    assert story.status("w-0") == ("Stopping", "Gang restart: w-2 was lost on n2")
    assert of(gone(story, 11, ["w-0", "w-1", "w-3"]), Place) == []  # not before the fence, though w-2's back-off ends
    assert story.step(20, TimerFired(timer=Timer.RESTART, task_id="w-2", attempt=0)) == []  # a stale timer: ignored
    (place,) = of(story.step(115, TimerFired(timer=Timer.RESTART, task_id="w-2", attempt=0)), Place)
    assert [(r.task_id, r.attempt) for r in place.requests] == [(t, 1) for t in IDS]
    assert story.history("w-2")[-3:] == [
        ("Down", "Machine lost: its lease expired"),
        ("Down", "Restarts at 2025-01-01 12:01:55 UTC, once its copy on n2 has surely stopped"),
        ("Pending", "Gang restart: w-2 was lost on n2"),
    ]
