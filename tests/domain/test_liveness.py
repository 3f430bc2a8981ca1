"""A machine's lease carries its workers' liveness (issue 39; workflows/domain/machine/liveness.py): the lease's timers,
what its runs hear when it is taken again, and what a run does when it hears its machine late or heard again
(workflows/domain/run/machines.py)."""

from __future__ import annotations

import pytest

from tests.domain.test_job import Story, at, running_story
from workflows.domain.machine.fence import fenced_after_late
from workflows.domain.machine.liveness import has_late_phase, late_after, noticed_late, renew_seconds, told_again
from workflows.domain.run.events import ArmTimer, MachineHeard, MachineLost, Timer, TimerFired
from workflows.domain.settings import Settings

# ---- the lease's timers ----------------------------------------------------------------------------------------


TIMERS = [
    # (id, settings, late after, renewed every, a late phase before the TTL?)
    ("the spec's defaults: Stale at 15 s, lost at 30 s", Settings(), 15, 5, True),
    ("a grace longer than the lease: lost first", Settings(stale_grace_seconds=60), 30, 10, False),
    ("a grace as long as the lease", Settings(stale_grace_seconds=30), 30, 10, False),
    ("a test's short lease: renewals never under 0.2 s", Settings(stale_grace_seconds=0.3), 0.3, 0.2, True),
]


@pytest.mark.parametrize(("settings", "late", "renew", "phase"), [t[1:] for t in TIMERS], ids=[t[0] for t in TIMERS])
def test_a_lease_is_late_after_the_grace_and_renewed_three_times_within_it(
    settings: Settings, late: float, renew: float, phase: bool
) -> None:
    assert (late_after(settings), renew_seconds(settings), has_late_phase(settings)) == (late, renew, phase)


NOTICED = [
    # (id, seconds since the last renewal when its lateness is decided, noticed late?)
    ("on time: the grace after the last renewal", 15.5, False),
    ("the grace, a renewal and the skew after it: still on time", 15 + 5 + 5, False),
    ("later than that: the cluster was away", 15 + 5 + 5.1, True),
    ("after Temporal was away 70 s", 75, True),
]


@pytest.mark.parametrize(("seconds", "late"), [n[1:] for n in NOTICED], ids=[n[0] for n in NOTICED])
def test_a_lateness_noticed_long_after_the_last_renewal_is_the_cluster_away(seconds: float, late: bool) -> None:
    assert noticed_late(at(0), at(seconds), Settings()) is late


def test_a_lateness_without_the_agents_time_is_noticed_on_time() -> None:
    assert noticed_late(None, at(1000), Settings()) is False  # agents from before sent no time with their renewals


TOLD = [
    # (id, heard late before, holder before, holder now, (tell, new agent))
    ("its first agent: nothing to tell", False, None, "host:1:a", (False, False)),
    (
        "the same agent again, never late: back (its watches attached again)",
        False,
        "host:1:a",
        "host:1:a",
        (True, False),
    ),
    ("the same agent after its runs heard it late: back", True, "host:1:a", "host:1:a", (True, False)),
    ("another agent: its runs attach their watches again", False, "host:1:a", "host:2:b", (True, True)),
    ("another agent after a late lease", True, "host:1:a", "host:2:b", (True, True)),
    ("an agent after the machine was lost: its runs heard that", False, None, "host:2:b", (False, False)),
]


@pytest.mark.parametrize(("late", "before", "now", "told"), [t[1:] for t in TOLD], ids=[t[0] for t in TOLD])
def test_what_the_runs_hear_when_a_lease_is_taken_again(
    late: bool, before: str | None, now: str, told: tuple[bool, bool]
) -> None:
    assert told_again(late, before, now) == told


def test_a_worker_counted_down_while_its_machine_is_late_restarts_after_the_fence_from_its_last_renewal() -> None:
    # Late at 100 s: Temporal recorded the last renewal 15 s before at the latest; the agent stops its workers 120 s
    # after it, each within its grace (10 s); clocks may differ by 5 s.
    assert fenced_after_late(at(100), Settings()) == at(100 - 15 + 120 + 10 + 5)


# ---- a run hears its machine --------------------------------------------------------------------------------------

QUICK = Settings(heartbeat_ttl_seconds=3)


def story(settings: Settings = QUICK, policy: str = "OnFailure") -> Story:
    """w-0 on n0 and w-1 on n1, Running at 4 s; a run of protocol 7 (its machines' leases carry its liveness)."""
    told = running_story(settings=settings, policy=policy)
    told.job.protocol = 7
    return told


def heard(second: float, late: bool, node: str = "n0", new_agent: bool = False) -> MachineHeard:
    return MachineHeard(node=node, late=late, at=at(second), new_agent=new_agent)


def test_a_late_machine_makes_its_running_workers_stale_and_heard_again_running() -> None:
    told = story()
    commands = told.step(10, heard(10, late=True))
    assert told.status("w-0") == ("Stale", "Heartbeat lease expired")
    assert told.status("w-1") == ("Running", "Container running")  # on another machine
    assert ArmTimer(timer=Timer.STALE_TTL, task_id="w-0", attempt=0, at=at(13)) in commands
    told.step(12, heard(12, late=False))
    assert told.history("w-0")[-2:] == [("Stale", "Heartbeat lease expired"), ("Running", "Heartbeat received")]
    told.step(13, TimerFired(timer=Timer.STALE_TTL, task_id="w-0", attempt=0))  # a moot timer: heard again
    assert told.status("w-0") == ("Running", "Heartbeat received")


def test_a_machine_late_for_a_workers_ttl_makes_it_down_and_it_restarts_no_sooner_than_its_fence() -> None:
    told = story()
    told.step(10, heard(10, late=True))
    told.step(13, TimerFired(timer=Timer.STALE_TTL, task_id="w-0", attempt=0))
    fence = fenced_after_late(at(10), QUICK)
    assert told.history("w-0")[-2:] == [
        ("Down", "No heartbeat for the worker's full TTL after going stale"),
        ("Down", f"Restarts at {fence:%Y-%m-%d %H:%M:%S} UTC, once its copy on n0 has surely stopped"),
    ]
    assert told.job.task("w-0").restart_at == fence


def test_a_late_machine_then_lost_takes_its_stale_workers_down() -> None:
    told = story()
    told.step(10, heard(10, late=True))
    told.step(25, MachineLost(node="n0", lost_at=at(25), fenced_at=at(130)))
    assert told.history("w-0")[-3:] == [
        ("Stale", "Heartbeat lease expired"),
        ("Down", "Machine lost: its lease expired"),
        ("Down", f"Restarts at {at(130):%Y-%m-%d %H:%M:%S} UTC, once its copy on n0 has surely stopped"),
    ]  # the machine's fence, not the one its lateness said
    assert told.job.task("w-0").restart_at == at(130)


def test_a_run_from_before_protocol_7_leaves_its_machines_liveness_to_its_watches() -> None:
    told = running_story(settings=QUICK)
    told.job.protocol = 6
    assert told.step(10, heard(10, late=True)) == []
    assert told.status("w-0") == ("Running", "Container running")


def test_a_moot_ttl_timer_a_machine_heard_that_was_not_late_and_another_machine_change_nothing() -> None:
    told = story()
    told.step(5, TimerFired(timer=Timer.STALE_TTL, task_id="w-0", attempt=0))  # nothing: not stale
    told.step(10, heard(10, late=False))  # heard again without being late: nothing
    assert told.status("w-0") == ("Running", "Container running")
    assert told.step(11, heard(11, late=True, node="n9")) == []  # a machine without its workers
    assert told.status("w-0") == ("Running", "Container running")


def test_heard_late_twice_keeps_the_first_stale_spell() -> None:
    told = story()
    told.step(10, heard(10, late=True))
    assert told.step(11, heard(11, late=True)) == []
    assert told.job.task("w-0").attempt.stale_since == at(10)
    assert told.job.task("w-0").attempt.fenced_until == fenced_after_late(at(10), QUICK)
