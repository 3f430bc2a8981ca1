"""The second wall: whatever one run carries that the core cannot decide is set aside with the error as its reason,
and every other run is decided as if it were not there (the first wall is the spec's bounds, tests/domain/test_spec.py).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from tests.domain.builders import T0, holding, machine, request
from workflows.domain.constraints import Drive
from workflows.domain.reasons import Reason
from workflows.domain.run.events import (
    Created,
    PlacementUpdate,
    Release,
    Stop,
    TaskEnded,
    TaskRunning,
    TaskStarted,
)
from workflows.domain.run.job import decide, fail_undecided, is_settled
from workflows.domain.run.status import JobRecord
from workflows.domain.run.tasks import new_job
from workflows.domain.scheduling.queue import schedule
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec

# A drive whose size no float holds: explaining where it fits raises (size_text), as any bug of the core might.
HUGE = {"huge": Drive(name="huge", size_bytes=10**400, node="n9")}
OVERFLOW = Reason("CannotBeScheduled", "Cannot be scheduled: OverflowError: int too large to convert to float")


def at(second: float) -> datetime:
    return T0 + timedelta(seconds=second)


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


# ---- a run whose decision raises ----------------------------------------------------------------------------------


def two_workers_one_running() -> JobRecord:
    """w-0 runs on n0 since second 4; w-1 waits for room."""
    spec = parse_spec({"name": "hello", "groups": [{"name": "w", "replicas": 2, "command": ["x"]}]})
    job = new_job(spec, Settings(), T0)
    for second, events in enumerate(
        [
            [Created()],
            [PlacementUpdate(task_id="w-0", attempt=0, node="n0")],
            [TaskStarted(task_id="w-0", attempt=0)],
            [TaskRunning(task_id="w-0", attempt=0)],
        ],
        start=1,
    ):
        job, _ = decide(job, list(events), at(second))
    return job


def states(job: JobRecord) -> dict[str, tuple[str, str, bool]]:
    return {"run": (job.status.state, job.status.reason, False)} | {
        t.id: (t.status.state, t.status.reason, t.final) for t in job.tasks
    }


def test_a_run_whose_events_cannot_be_decided_fails_and_stops_its_workers() -> None:
    failed, commands = fail_undecided(two_workers_one_running(), "KeyError: 'w-9'", at(10))
    assert states(failed) == {
        "run": ("Failed", "Cannot be decided: KeyError: 'w-9'", False),
        "w-0": ("Stopping", "Run failed", False),
        "w-1": ("Cancelled", "Run failed", True),
    }
    assert (failed.status.code, failed.status.finished_at) == ("CannotBeDecided", at(10))
    assert commands == [Stop(task_id="w-0", attempt=0, node="n0"), Release(task_id="w-1", attempt=0)]
    ended, _ = decide(failed, [TaskEnded(task_id="w-0", attempt=0, exit_code=143)], at(11))
    assert states(ended)["w-0"] == ("Cancelled", "Stopped on request", True)
    assert is_settled(ended)


def test_a_failed_run_whose_stop_reports_cannot_be_decided_either_closes_once_its_stops_return() -> None:
    failed, _ = fail_undecided(two_workers_one_running(), "KeyError: 'w-9'", at(10))
    again, commands = fail_undecided(failed, "KeyError: 'w-9'", at(11))
    assert states(again) == {
        "run": ("Failed", "Cannot be decided: KeyError: 'w-9'", False),
        "w-0": ("Stopping", "Run failed", True),
        "w-1": ("Cancelled", "Run failed", True),
    }
    assert commands == []
    assert is_settled(again)
