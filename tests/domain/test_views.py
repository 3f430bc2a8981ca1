"""What clients show of a run whose workflow was terminated in Temporal: Terminated, with Temporal's reason."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from workflows.domain.run.events import Created
from workflows.domain.run.job import decide
from workflows.domain.run.tasks import new_job
from workflows.domain.run.views import describe, events, terminated_description, terminated_events, terminated_status
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
KILLED = T0 + timedelta(minutes=5)


def pending_run():  # type: ignore[no-untyped-def]
    spec = parse_spec({"name": "sleepy", "groups": [{"name": "w", "command": ["sleep", "600"]}]})
    job, _ = decide(new_job(spec, Settings(), T0), [Created()], T0)
    return job


@pytest.mark.parametrize(
    ("why", "reason"),
    [
        pytest.param("stuck", "Its workflow was terminated in Temporal: stuck", id="Temporal's reason is shown"),
        pytest.param("", "Its workflow was terminated in Temporal: no reason given", id="an empty reason says so"),
    ],
)
def test_a_terminated_run_says_so_in_its_status_history_and_events(why: str, reason: str) -> None:
    job = pending_run()
    described = terminated_description(describe(job), why, KILLED)
    assert (described.status.state, described.status.reason, described.status.code) == (
        "Terminated",
        reason,
        "RunTerminated",
    )
    assert described.status.finished_at == KILLED
    assert described.status.created_at == T0
    assert [(e.state, e.reason, e.at) for e in described.history] == [
        *[(e.state, e.reason, e.at) for e in job.history],
        ("Terminated", reason, KILLED),
    ]
    assert described.tasks == describe(job).tasks  # the workers show what the run last knew of them
    assert terminated_status(job.status, why, KILLED) == described.status
    stream = terminated_events(events(job), why, KILLED)
    assert [(e.object, e.state, e.reason) for e in stream[-2:]] == [
        ("w-0", "Pending", "Waiting for workers to start"),
        ("run", "Terminated", reason),
    ]
