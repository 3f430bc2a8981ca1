"""The second wall: whatever one run carries that the core cannot decide is set aside with the error as its reason,
and every other run is decided as if it were not there (the first wall is the spec's bounds, tests/domain/test_spec.py).
"""

from __future__ import annotations

from tests.domain.builders import T0, holding, machine, request
from workflows.domain.constraints import Drive
from workflows.domain.reasons import Reason
from workflows.domain.scheduling import schedule

# A drive whose size no float holds: explaining where it fits raises (size_text), as any bug of the core might.
HUGE = {"huge": Drive(name="huge", size_bytes=10**400, node="n9")}
OVERFLOW = Reason("CannotBeScheduled", "Cannot be scheduled: OverflowError: int too large to convert to float")


def outcome(plan) -> dict[str, tuple[str | None, Reason | None]]:  # type: ignore[no-untyped-def]
    return {f"{d.request.run}/{d.request.task_id}": (d.node, d.reason) for d in plan.decisions}


def test_a_worker_whose_decision_raises_waits_with_the_error_and_the_others_are_placed() -> None:
    nodes = [machine("n0", gpus=2, data_free_bytes=2**30), machine("n1", gpus=2)]
    requests = [
        request("w-0", run="bad", priority=9, drives=("huge",)),
        request("w-0", run="good", gpus=2, submitted=1),
        request("w-0", run="also", gpus=2, submitted=2),
    ]
    plan = schedule(requests, nodes, [], T0, drives=HUGE)
    assert outcome(plan) == {"bad/w-0": (None, OVERFLOW), "good/w-0": ("n0", None), "also/w-0": ("n1", None)}


def test_a_gang_whose_decision_raises_half_way_gives_back_the_room_it_took() -> None:
    """The gang's first member takes n0, then deciding its second raises: n0 is free again for the next run."""
    nodes = [machine("n0", gpus=2, data_free_bytes=2**30)]
    gang = {"gang": True, "priority": 9}
    requests = [
        request("w-0", run="bad", gpus=2, group="w", **gang),
        request("d-0", run="bad", index=1, group="d", drives=("huge",), **gang),
        request("w-0", run="good", gpus=2, submitted=1),
    ]
    plan = schedule(requests, nodes, [], T0, drives=HUGE)
    assert outcome(plan) == {
        "bad/w-0": (None, OVERFLOW),
        "bad/d-0": (None, OVERFLOW),
        "good/w-0": ("n0", None),
    }
    assert (plan.holds, plan.preemptions) == ({}, [])


def test_a_placed_worker_whose_time_limit_runs_past_the_calendar_counts_as_having_none() -> None:
    """An allocation of a run accepted before time limits were bounded: its end is not a date, so it holds its
    machine until released, and the head waits for running work to end rather than the pass raising."""
    nodes = [machine("n0", gpus=2)]
    held = [holding("n0", gpus=2, limit=1e300)]
    plan = schedule([request("w-0", run="head", gpus=2), request("w-0", run="next", cpu=1, limit=60)], nodes, held, T0)
    assert outcome(plan) == {
        "head/w-0": (None, Reason("NextToRunWaits", "Next to run (priority 0): waits for running work to end")),
        "next/w-0": (None, Reason("QueuedBehind", "Queued behind head")),
    }
