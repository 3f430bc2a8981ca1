"""A worker's record: records of the flat shape (before the worker, its attempt, its stop and what follows its end
were split) load into the new one meaning the same, so continue-as-new inputs of older runs still resume; but for
the back-off a worker ended for good still showed, which is dropped (it never comes).

`flat_task_records.json` holds workers as `decide` left them before the split, one of each combination of the
old flags that random event sequences reached (final, restart_at, requeue, stop_cause, stopped, preempted_by,
exceeded)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from workflows.domain.reasons import UNCODED, R, Reason
from workflows.domain.run.status import (
    Attempt,
    Final,
    JobRecord,
    RequeueWithGang,
    RestartAt,
    Status,
    StopIntent,
    TaskRecord,
)
from workflows.domain.run.tasks import new_job
from workflows.domain.run.views import describe
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
FLAT = json.loads((Path(__file__).parent / "flat_task_records.json").read_text())


class Meaning(BaseModel):
    """What the flat fields said, each as it was read."""

    model_config = ConfigDict(extra="forbid")

    attempt: int
    node: str | None
    address: str | None
    running_since: datetime | None
    stale_since: datetime | None
    released: bool
    healthy: bool | None
    final: bool
    restart_at: datetime | None
    requeue: Reason | None
    stopped: bool
    stop_cause: str | None
    preempted_by: str | None
    exceeded: str | None


def flat_meaning(flat: dict[str, Any]) -> Meaning:
    meaning = Meaning.model_validate({key: flat[key] for key in Meaning.model_fields})
    # A worker ended for good never read its requeue again (every reader asks for one not final first), and the
    # back-off it still showed (a gang restart's, kept when it was stopped for good meanwhile) never comes: it is
    # dropped, so `describe` no longer shows the worker restarting.
    return meaning.model_copy(update={"requeue": None, "restart_at": None}) if meaning.final else meaning


def meaning(task: TaskRecord) -> Meaning:
    return Meaning(
        attempt=task.attempt.number,
        node=task.attempt.node,
        address=task.attempt.address,
        running_since=task.attempt.running_since,
        stale_since=task.attempt.stale_since,
        released=task.attempt.released,
        healthy=task.attempt.healthy,
        final=task.final,
        restart_at=task.restart_at,
        requeue=task.after.reason if isinstance(task.after, RequeueWithGang) else None,
        stopped=task.stopped,
        stop_cause=None if task.stop is None or task.stop.cause == "requested" else task.stop.cause,
        preempted_by=task.preempted_by,
        exceeded=task.exceeded,
    )


def combination(flat: dict[str, Any]) -> str:
    flags = ["final", "restart_at", "requeue", "stopped", "preempted_by", "exceeded"]
    return "-".join([flat["status"]["state"], *(f for f in flags if flat[f]), flat["stop_cause"] or "no-cause"])


@pytest.mark.parametrize("flat", FLAT, ids=[combination(f) for f in FLAT])
def test_a_flat_record_as_decide_left_it_loads_meaning_the_same(flat: dict[str, Any]) -> None:
    task = TaskRecord.model_validate(flat)
    assert meaning(task) == flat_meaning(flat)
    kept = (
        "id",
        "group",
        "index",
        "restarts",
        "gated",
        "summarised",
        "status",
        "history",
        "last_failure",
        "waiting_on",
    )
    # Per-machine reasons of old records are sentences: they load as reasons of an unknown code (tests/workflows/
    # test_wire.py), the rest as they were.
    uncoded = [
        {"name": n["name"], "reasons": [{"code": UNCODED, "text": text} for text in n["reasons"]]}
        for n in flat["waiting_on"]
    ]
    assert {key: task.model_dump(mode="json")[key] for key in kept} == {**{key: flat[key] for key in kept},
                                                                        "waiting_on": uncoded}  # fmt: skip
    # Loaded, it is of the new shape, and stays so through a dump and a load.
    again = TaskRecord.model_validate_json(task.model_dump_json())
    assert again == task


def test_a_flat_record_with_every_old_field_set_loads_into_the_new_shape() -> None:
    requeue = R.GangRestart(task="w-1")
    flat = {
        "id": "w-0",
        "group": "w",
        "index": 0,
        "attempt": 3,
        "node": "n1",
        "restarts": 2,
        "restart_at": "2025-01-01T12:05:00Z",
        "final": False,
        "stopped": False,
        "stop_cause": "gang_restart",
        "preempted_by": "ns/urgent",
        "exceeded": "30s",
        "requeue": {"code": requeue.code, "text": requeue.text},
        "running_since": "2025-01-01T12:01:00Z",
        "stale_since": "2025-01-01T12:02:00Z",
        "address": "10.0.0.1",
        "released": True,
        "healthy": True,
        "gated": True,
        "summarised": 4,
        "status": {
            "state": "Stopping",
            "reason": requeue.text,
            "code": requeue.code,
            "created_at": "2025-01-01T12:00:00Z",
        },
        "history": [],
        "last_failure": None,
        "waiting_on": [{"name": "n2", "reasons": ["insufficient gpus: need 8, 4 free and usable"]}],
    }
    task = TaskRecord.model_validate(flat)
    assert task.attempt == Attempt(
        number=3,
        node="n1",
        address="10.0.0.1",
        running_since=datetime(2025, 1, 1, 12, 1, tzinfo=UTC),
        stale_since=datetime(2025, 1, 1, 12, 2, tzinfo=UTC),
        released=True,
        healthy=True,
    )
    assert task.stop == StopIntent(cause="gang_restart")
    assert task.after == RequeueWithGang(reason=requeue, at=datetime(2025, 1, 1, 12, 5, tzinfo=UTC))
    assert (task.restarts, task.gated, task.summarised, task.preempted_by, task.exceeded) == (
        2,
        True,
        4,
        "ns/urgent",
        "30s",
    )
    assert task.waiting_on[0].name == "n2"
    assert meaning(task) == flat_meaning(flat)


@pytest.mark.parametrize(
    ("flags", "stop", "after"),
    [
        pytest.param({}, None, None, id="nothing-decided"),
        pytest.param({"stopped": True}, StopIntent(cause="requested"), None, id="stopped-on-request"),
        pytest.param(
            {"stopped": True, "stop_cause": "time_limit"}, StopIntent(cause="time_limit"), None, id="time-limit"
        ),
        pytest.param({"stop_cause": "preempted"}, StopIntent(cause="preempted"), None, id="preempted"),
        pytest.param({"final": True}, None, Final(), id="final"),
        pytest.param(
            {"final": True, "restart_at": "2025-01-01T12:05:00Z"},
            None,
            Final(),
            id="final-no-longer-showing-a-gang-back-off",
        ),
        pytest.param(
            {"restart_at": "2025-01-01T12:05:00Z"},
            None,
            RestartAt(at=datetime(2025, 1, 1, 12, 5, tzinfo=UTC)),
            id="back-off",
        ),
        pytest.param(
            {"requeue": {"code": "GangBarrierTimedOut", "text": R.GangBarrierTimedOut().text}, "stop_cause": "barrier"},
            StopIntent(cause="barrier"),
            RequeueWithGang(reason=R.GangBarrierTimedOut()),
            id="barrier-timed-out",
        ),
    ],
)
def test_each_old_flag_combination_maps_to_one_stop_and_one_after(
    flags: dict[str, Any], stop: StopIntent | None, after: Final | RestartAt | RequeueWithGang | None
) -> None:
    status = {"state": "Pending", "reason": "x", "code": "x", "created_at": "2025-01-01T12:00:00Z"}
    task = TaskRecord.model_validate({"id": "w-0", "group": "w", "index": 0, "attempt": 0, "status": status, **flags})
    assert (task.stop, task.after) == (stop, after)


def run_with(tasks: list[dict[str, Any]]) -> JobRecord:
    spec = parse_spec({"name": "old", "groups": [{"name": "w", "replicas": len(tasks), "command": ["x"]}]})
    dumped = new_job(spec, Settings(), T0).model_dump(mode="json")
    return JobRecord.model_validate({**dumped, "tasks": tasks})


def test_a_continue_as_new_input_of_an_older_run_loads_and_describes_as_before() -> None:
    flat = [dict(f, id=f"w-{i}", index=i) for i, f in enumerate(FLAT)]
    job = run_with(flat)
    shown = describe(job).model_dump(mode="json")["tasks"]
    for view, old in zip(shown, flat, strict=True):
        fields = ("id", "group", "node", "attempt", "restarts", "restart_at", "status", "history", "last_failure")
        shown_before = {key: old[key] for key in (*fields, "healthy")}
        if old["final"]:
            shown_before["restart_at"] = None  # ended for good: no back-off to show (see flat_meaning)
        assert {key: view[key] for key in (*fields, "healthy")} == shown_before


def test_a_record_of_the_new_shape_is_not_mistaken_for_a_flat_one() -> None:
    status = Status(state="Pending", reason="x", code="x", created_at=T0)
    task = TaskRecord(id="w-0", group="w", index=0, status=status, attempt=Attempt(number=2, node="n1"))
    assert TaskRecord.model_validate(task.model_dump(mode="json")) == task
    assert TaskRecord.model_validate(task.model_dump()) == task
