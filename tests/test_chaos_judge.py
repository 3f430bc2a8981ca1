"""bench.chaos_judge: the longer faults' checks on hand-made journals (intervals), read-backs and faults."""

from __future__ import annotations

import pytest

from bench.chaos_checks import Fault, Interval, RunRead, not_as_named, started_twice
from bench.chaos_judge import (
    failed_while_running,
    gang_alone,
    history_hits,
    judge_fault,
    run_again_after_exit,
    started_while_lost,
    stopped_or_restarted,
    two_copies,
)


def iv(
    run: str, attempt: int, node: str, start: float, end: float | None, code: int | None = 0, task: str = "w-0"
) -> Interval:
    return Interval(f"chaos/{run}", task, attempt, node, (0,), 100 + attempt, start, end, code)


@pytest.mark.parametrize(
    ("intervals", "moments"),
    [
        ([iv("a", 0, "m-0", 0, 10)], []),
        ([iv("a", 0, "m-0", 0, 10, 143), iv("a", 1, "m-1", 10, 20)], []),  # one after the other
        ([iv("a", 0, "m-0", 0, 10), iv("a", 1, "m-1", 4, 20)], [(4, 10, 2)]),
        ([iv("a", 0, "m-0", 0, None), iv("a", 1, "m-1", 5, 20)], [(5, 20, 2)]),  # still alive at the end (30)
        ([iv("a", 0, "m-0", 0, 10), iv("b", 0, "m-0", 4, 20)], []),  # two workers, not two copies
        ([iv("a", 0, "m-0", 0, 10), iv("a", 1, "m-1", 2, 4), iv("a", 2, "m-1", 6, 8)], [(2, 4, 2), (6, 8, 2)]),
        ([iv("a", 0, "m-0", 0, 10), iv("a", 1, "m-1", 2, 8), iv("a", 2, "m-1", 3, 12)], [(2, 10, 3)]),
    ],
    ids=["one copy", "in turn", "overlap", "open", "other workers", "two moments", "three copies"],
)
def test_moments_with_two_live_copies_of_a_worker(
    intervals: list[Interval], moments: list[tuple[float, float, int]]
) -> None:
    assert [(m.start, m.end, m.copies) for m in two_copies(intervals, until=30)] == moments


def test_a_run_failed_while_its_worker_still_ran_is_found() -> None:
    runs = [
        RunRead("chaos/a", state="Failed", reason="Worker w-0 was lost", closed=True, closed_at=10),
        RunRead("chaos/b", state="Failed", reason="Worker w-0 was lost", closed=True, closed_at=10),
        RunRead("chaos/c", state="Completed", closed=True, closed_at=10),
    ]
    intervals = [iv("a", 0, "m-0", 0, 25, 143), iv("b", 0, "m-0", 0, 9, None), iv("c", 0, "m-0", 0, None)]
    found = failed_while_running(runs, intervals, until=40)
    assert len(found) == 1 and found[0].startswith("chaos/a: Failed") and "ran 15.0 s on" in found[0]


def test_workers_running_at_a_fault_that_it_stopped_or_restarted_are_found() -> None:
    intervals = [
        iv("a", 0, "m-0", 0, 30),  # ran through: fine
        iv("b", 0, "m-0", 0, 12, 143),  # stopped
        iv("c", 0, "m-0", 0, 14, None),  # killed: no end line (its exit file says when)
        iv("d", 0, "m-0", 0, None, None),  # alive throughout, but its worker started again elsewhere:
        iv("d", 1, "m-1", 20, 25),
        iv("e", 0, "m-0", 11, 15, 143),  # started after the fault: not the fault's running worker
    ]
    found = stopped_or_restarted(intervals, at=10, until=60)
    assert [f.split(":")[0] for f in found] == ["chaos/b/w-0", "chaos/c/w-0", "chaos/d/w-0"]


def test_a_finished_worker_started_again_after_the_fault_is_found() -> None:
    intervals = [
        iv("a", 0, "m-0", 0, 5),  # exited 0 before the fault...
        iv("a", 1, "m-1", 20, 25),  # ... and ran again after it
        iv("b", 0, "m-0", 0, 5, 143),  # stopped, then restarted: not a finished worker
        iv("b", 1, "m-1", 20, 25),
        iv("c", 0, "m-0", 0, 5),  # re-run before the fault: an older fault's
        iv("c", 1, "m-1", 6, 8),
    ]
    assert [f.split(":")[0] for f in run_again_after_exit(intervals, since=10)] == ["chaos/a/w-0"]


def test_a_gang_running_incomplete_and_members_started_while_a_machine_was_lost() -> None:
    gang = [
        iv("g", 0, "m-0", 10, 23, 0, task="w-0"),
        iv("g", 0, "m-0", 10, 23, 0, task="w-1"),
        iv("g", 0, "m-1", 20, 30, 0, task="w-2"),
        iv("g", 0, "m-1", 20, 30, 0, task="w-3"),
    ]
    seconds, spans = gang_alone(gang, "chaos/g", members=4, until=40)
    assert seconds == pytest.approx(10 + 7) and len(spans) == 2
    fault = Fault("gang-barrier-kill", "agents-1", "m-1", killed=5, restarted=18)
    assert [s.split(" ")[0] for s in started_while_lost(gang, "chaos/g", fault)] == [
        "chaos.g.w-0.0",
        "chaos.g.w-1.0",
    ]
    whole = [iv("g", 0, f"m-{i // 2}", 10 + i * 0.1, 20 + i * 0.1, 0, task=f"w-{i}") for i in range(4)]
    assert gang_alone(whole, "chaos/g", members=4, until=40) == (0.0, [])


def test_history_entries_are_found_by_their_words_within_a_window() -> None:
    runs = [
        RunRead("chaos/a", history=[(5.0, "NoMachinesRegistered", "No machine fits: no machines are registered")]),
        RunRead("chaos/b", history=[(50.0, "NoMachinesRegistered", "No machine fits: no machines are registered")]),
        RunRead("chaos/c", history=[(6.0, "StartRefused", "Start refused: attempt 1 of worker w-0 is no longer")]),
    ]
    assert history_hits(runs, "no machines are registered", 0, 10) == [
        "chaos/a: No machine fits: no machines are registered"
    ]
    assert len(history_hits(runs, "REFUSED", 0, 10)) == 1


def test_each_longer_fault_has_its_checks_and_a_line_and_the_old_ones_none() -> None:
    intervals = [iv("a", 0, "m-1", 0, 60), iv("a", 1, "m-0", 20, 30)]
    partition = Fault("partition", "agents-1", "m-1", killed=5, restarted=50, extra={"seconds": 45})
    judged = judge_fault(partition, [], intervals, until=70, next_kill=None)
    assert judged is not None
    assert dict(judged.checks)["partition: moments with two live copies of a worker"]
    assert "two live copies 1 moments (1 workers), 10.0 s in all" in judged.line
    assert judge_fault(Fault("control", "control", killed=5), [], intervals, 70, None) is None
    for name in ("temporal-away", "two-schedulers", "gang-barrier-kill", "full-disk"):
        one = judge_fault(Fault(name, "x", "m-1", killed=5, restarted=10), [], [], 70, None)
        assert one is not None and one.checks and all(not cases for _, cases in one.checks), name


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        (Fault("partition", "agents-1", "m-1", alive_at_kill=2), True),
        (Fault("partition", "agents-1", "m-1", alive_at_kill=0, waiting_at_kill=5), False),
        (Fault("full-disk", "agents-1", "m-1", alive_at_kill=1, waiting_at_kill=0), True),
        (Fault("gang-barrier-kill", "agents-1", "m-1", waiting_at_kill=0), True),
    ],
    ids=["a partition with workers alive", "one with none", "a full disk after the burst", "a gang's, after it"],
)
def test_a_longer_fault_is_named_by_the_workers_alive_when_it_hit(fault: Fault, named: bool) -> None:
    assert (not_as_named(fault) is None) == named


def test_a_rerun_after_an_exit_on_a_full_disk_counts_though_the_fault_has_a_machine() -> None:
    intervals = [iv("a", 0, "m-1", 1, 4), iv("a", 1, "m-0", 6, 8)]
    full = Fault("full-disk", "agents-1", "m-1", killed=3.0, restarted=7.0)
    found = started_twice(intervals, [full])
    assert (len(found.after_completing), len(found.unseen_end)) == (1, 0)
