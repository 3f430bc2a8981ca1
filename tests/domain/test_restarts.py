"""Restarts: the spec's policy table, back-off ladder, budget and reset."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from workflows.domain.reasons import Reason
from workflows.domain.run.restarts import RestartDecision, backoff, decide_restart, restarted_reason
from workflows.domain.run.status import TaskState
from workflows.domain.settings import Settings
from workflows.domain.spec import RestartPolicy

NOW = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
DEFAULTS = Settings()
# Shrunk for tests: 1 s, doubling, at most 4 s; 2 restarts; reset after 5 s Running.
SHRUNK = Settings(backoff_base_seconds=1, backoff_cap_seconds=4, restart_budget=2, restart_reset_seconds=5)


def seconds(n: float) -> timedelta:
    return timedelta(seconds=n)


@pytest.mark.parametrize(
    ("restarts", "wait"),
    [
        pytest.param(0, 10, id="10 s before the first restart"),
        pytest.param(1, 20, id="20 s before the second"),
        pytest.param(2, 40, id="40 s before the third"),
        pytest.param(3, 80, id="80 s before the fourth"),
        pytest.param(4, 160, id="160 s before the fifth"),
        pytest.param(5, 300, id="capped at 5 min before the sixth"),
        pytest.param(6, 300, id="still 5 min before the seventh"),
        pytest.param(1000, 300, id="still 5 min after very many"),
    ],
)
def test_the_backoff_ladder(restarts: int, wait: float) -> None:
    assert backoff(restarts, DEFAULTS) == seconds(wait)


@pytest.mark.parametrize(
    ("restarts", "wait"),
    [
        pytest.param(0, 1, id="shrunk: 1 s first"),
        pytest.param(1, 2, id="shrunk: 2 s second"),
        pytest.param(2, 4, id="shrunk: 4 s third"),
        pytest.param(3, 4, id="shrunk: capped at 4 s"),
    ],
)
def test_shrunk_settings_shrink_the_ladder(restarts: int, wait: float) -> None:
    assert backoff(restarts, SHRUNK) == seconds(wait)


@pytest.mark.parametrize(
    ("restarts", "wait"),
    [pytest.param(n, w, id=f"after {n} restarts the worker restarts in {w} s") for n, w in enumerate([10, 20, 40])],
)
def test_a_restart_is_due_after_the_backoff(restarts: int, wait: float) -> None:
    decision = decide_restart("OnFailure", TaskState.FAILED, restarts, None, NOW, DEFAULTS)
    assert decision == RestartDecision(restarts, NOW + seconds(wait))


# The spec's Restarts table, row by row, against every ended state.
POLICY_TABLE: list[tuple[RestartPolicy, TaskState, bool]] = [
    ("OnFailure", TaskState.FAILED, True),
    ("OnFailure", TaskState.DOWN, True),
    ("OnFailure", TaskState.COMPLETED, False),
    ("OnFailure", TaskState.CANCELLED, False),
    ("Always", TaskState.FAILED, True),
    ("Always", TaskState.DOWN, True),
    ("Always", TaskState.COMPLETED, True),
    ("Always", TaskState.CANCELLED, False),
    ("Never", TaskState.FAILED, False),
    ("Never", TaskState.DOWN, False),
    ("Never", TaskState.COMPLETED, False),
    ("Never", TaskState.CANCELLED, False),
]


@pytest.mark.parametrize(
    ("policy", "ended", "restarts"),
    [
        pytest.param(p, s, r, id=f"{p} {'restarts' if r else 'does not restart'} a worker that ended {s}")
        for p, s, r in POLICY_TABLE
    ],
)
def test_the_policy_table(policy: RestartPolicy, ended: TaskState, restarts: bool) -> None:
    decision = decide_restart(policy, ended, 0, None, NOW, DEFAULTS)
    expected = RestartDecision(0, NOW + seconds(10)) if restarts else RestartDecision(0, None)
    assert decision == expected


def test_down_with_never_fails_for_good_without_a_new_reason() -> None:
    assert decide_restart("Never", TaskState.DOWN, 3, None, NOW, DEFAULTS) == RestartDecision(3, None, None)


@pytest.mark.parametrize(
    ("settings", "restarts", "expected"),
    [
        pytest.param(
            DEFAULTS,
            10,
            RestartDecision(10, None, Reason("RetryBudgetExhausted", "Retry budget exhausted after 10/10 restarts")),
            id="after 10 restarts the next failure is final",
        ),
        pytest.param(DEFAULTS, 9, RestartDecision(9, NOW + seconds(300)), id="after 9 restarts it restarts once more"),
        pytest.param(
            SHRUNK,
            2,
            RestartDecision(2, None, Reason("RetryBudgetExhausted", "Retry budget exhausted after 2/2 restarts")),
            id="a shrunk budget of 2 is exhausted after 2 restarts",
        ),
        pytest.param(SHRUNK, 1, RestartDecision(1, NOW + seconds(2)), id="a shrunk budget has room for a second"),
        pytest.param(
            Settings(restart_budget=0),
            0,
            RestartDecision(0, None, Reason("RetryBudgetExhausted", "Retry budget exhausted after 0/0 restarts")),
            id="a budget of 0 makes the first failure final",
        ),
    ],
)
def test_the_budget(settings: Settings, restarts: int, expected: RestartDecision) -> None:
    assert decide_restart("OnFailure", TaskState.FAILED, restarts, None, NOW, settings) == expected


def test_an_exhausted_budget_is_final_also_when_lost() -> None:
    decision = decide_restart("Always", TaskState.DOWN, 10, None, NOW, DEFAULTS)
    assert decision.restart_at is None
    assert decision.final_reason == Reason("RetryBudgetExhausted", "Retry budget exhausted after 10/10 restarts")


@pytest.mark.parametrize(
    ("settings", "ran", "restarts", "expected"),
    [
        pytest.param(DEFAULTS, 600, 5, RestartDecision(0, NOW + seconds(10)), id="10 min running resets the count"),
        pytest.param(DEFAULTS, 3600, 10, RestartDecision(0, NOW + seconds(10)), id="a reset refills a spent budget"),
        pytest.param(DEFAULTS, 599, 5, RestartDecision(5, NOW + seconds(300)), id="599 s running keeps the count"),
        pytest.param(SHRUNK, 5, 2, RestartDecision(0, NOW + seconds(1)), id="shrunk: 5 s running resets the count"),
        pytest.param(
            SHRUNK,
            4,
            2,
            RestartDecision(2, None, Reason("RetryBudgetExhausted", "Retry budget exhausted after 2/2 restarts")),
            id="shrunk: 4 s running is not enough to reset",
        ),
    ],
)
def test_the_reset(settings: Settings, ran: float, restarts: int, expected: RestartDecision) -> None:
    decision = decide_restart("OnFailure", TaskState.FAILED, restarts, NOW - seconds(ran), NOW, settings)
    assert decision == expected


def test_a_reset_also_applies_when_the_policy_does_not_restart() -> None:
    decision = decide_restart("Never", TaskState.FAILED, 4, NOW - seconds(600), NOW, DEFAULTS)
    assert decision == RestartDecision(0, None)


@pytest.mark.parametrize(
    ("restarts", "settings", "text"),
    [
        pytest.param(1, DEFAULTS, "Restarted by policy (restart 1/10)", id="the first restart of 10"),
        pytest.param(2, DEFAULTS, "Restarted by policy (restart 2/10)", id="the second restart of 10"),
        pytest.param(2, SHRUNK, "Restarted by policy (restart 2/2)", id="the last restart of a shrunk budget"),
    ],
)
def test_the_restarted_reason(restarts: int, settings: Settings, text: str) -> None:
    assert restarted_reason(restarts, settings) == Reason("RestartedByPolicy", text)
