"""Properties of `decide` over random event sequences, as the JobWorkflow and the outside world could send them.

A small simulated shell answers each command the way the workflow does (a placement answer per request; a
started or setup failure per start, then a running report and an end; a gang member's set-up answers ready, and
a stop of a worker that runs nothing is confirmed by the stop itself; a due timer per armed restart or barrier),
and a person cancels the run or stops workers when the workflow's validators let them. Each example is a list of
choices, so a failing sequence replays exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from hypothesis import example, given, settings
from hypothesis import strategies as st

from workflows.domain.reasons import Reason
from workflows.domain.run.events import (
    ArmTimer,
    CancelRequested,
    Command,
    Created,
    Event,
    Place,
    PlacementUpdate,
    Release,
    Start,
    Stop,
    StopConfirmed,
    StopRequested,
    TaskEnded,
    TaskReady,
    TaskRunning,
    TaskSetupFailed,
    TaskStarted,
    Timer,
    TimerFired,
)
from workflows.domain.run.job import decide
from workflows.domain.run.status import RUN_TERMINAL, JobRecord, RunState, TaskState
from workflows.domain.run.tasks import new_job
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, parse_spec

T0 = datetime(2025, 1, 1, 12, 0, tzinfo=UTC)
SHRUNK = Settings(backoff_base_seconds=1, backoff_cap_seconds=4, restart_budget=2, restart_reset_seconds=30)

NO_FIT = "No machine fits: 0 of 1 machines ready"
ENDINGS: list[dict[str, Any]] = [
    {"exit_code": 0},
    {"exit_code": 1, "log_tail": "boom\n"},
    {"exit_code": 137, "oom": True},
    {"exit_code": 143},
    {"not_found": True},
]


def spec(policy: str, gang: bool = False) -> JobSpec:
    return parse_spec(
        {
            "name": "p",
            "gang": gang,
            "groups": [{"name": "w", "replicas": 2, "command": ["x"], "restart_policy": policy}],
        }
    )


@dataclass
class World:
    """What the outside world may send next, learned from the commands `decide` gave."""

    waiting: set[tuple[str, int]] = field(default_factory=set)  # placement requests not yet granted
    starting: set[tuple[str, int, str]] = field(default_factory=set)  # start_task in flight
    setting_up: set[tuple[str, int]] = field(default_factory=set)  # a gang member's set-up in flight (barrier)
    stopping: set[tuple[str, int]] = field(default_factory=set)  # stops of workers that run nothing
    supervised: set[tuple[str, int]] = field(default_factory=set)  # started: a running report and an end follow
    reported: set[tuple[str, int]] = field(default_factory=set)  # running report sent
    timers: dict[tuple[str, int], datetime] = field(default_factory=dict)
    kinds: dict[tuple[str, int], Timer] = field(default_factory=dict)  # each armed timer's kind

    def learn(self, commands: list[Command]) -> None:
        for command in commands:
            match command:
                case Place(requests=requests):
                    self.waiting |= {(r.task_id, r.attempt) for r in requests}
                case Start(task_id=task, attempt=attempt, barrier=True):
                    self.setting_up.add((task, attempt))
                case Start(task_id=task, attempt=attempt, node=node):
                    self.starting.add((task, attempt, node))
                case Stop(task_id=task, attempt=attempt) if not self.busy(task, attempt):
                    self.stopping.add((task, attempt))  # nothing runs: the stop call confirms it
                case ArmTimer(timer=Timer.RESTART | Timer.BARRIER, task_id=task, attempt=attempt, at=at) as arm:
                    self.timers[(task, attempt)] = at
                    self.kinds[(task, attempt)] = arm.timer
                case Release(task_id=task, attempt=attempt):
                    self.waiting.discard((task, attempt))

    def busy(self, task: str, attempt: int) -> bool:
        """A call about the worker is in flight (a start, a set-up, a supervisor): it reports what follows."""
        key = (task, attempt)
        return key in self.supervised or key in self.setting_up or any(s[:2] == key for s in self.starting)

    def options(self, job: JobRecord) -> list[Event]:
        """Every event that may come next, in a fixed order."""
        found: list[Event] = []
        for task, attempt in sorted(self.waiting):
            found.append(PlacementUpdate(task_id=task, attempt=attempt, node=f"n{attempt % 2}"))
            found.append(PlacementUpdate(task_id=task, attempt=attempt, code="NoMachineFits", reason=NO_FIT))
        for task, attempt in sorted(self.setting_up):
            found.append(TaskReady(task_id=task, attempt=attempt))
            found.append(
                TaskSetupFailed(task_id=task, attempt=attempt, reason=Reason("ErrImagePull", "ErrImagePull: x"))
            )
        found += [StopConfirmed(task_id=task, attempt=attempt) for task, attempt in sorted(self.stopping)]
        for task, attempt, _ in sorted(self.starting):
            found.append(TaskStarted(task_id=task, attempt=attempt))
            found.append(
                TaskSetupFailed(task_id=task, attempt=attempt, reason=Reason("ErrImagePull", "ErrImagePull: x"))
            )
        for task, attempt in sorted(self.supervised):
            if (task, attempt) not in self.reported:
                found.append(TaskRunning(task_id=task, attempt=attempt))
            found += [TaskEnded(task_id=task, attempt=attempt, **ending) for ending in ENDINGS]
        found += [
            TimerFired(timer=self.kinds[(task, attempt)], task_id=task, attempt=attempt)
            for task, attempt in sorted(self.timers)
        ]
        # A person, through the workflow's validators: cancel once, stop a worker not final and not stopping.
        if job.state not in RUN_TERMINAL and not job.cancel_requested:
            found.append(CancelRequested())
        found += [StopRequested(task_id=t.id) for t in job.tasks if not t.final and t.state is not TaskState.STOPPING]
        return found

    def consume(self, event: Event) -> None:
        match event:
            case PlacementUpdate(task_id=task, attempt=attempt) if event.node is not None:
                self.waiting.discard((task, attempt))
            case TaskStarted(task_id=task, attempt=attempt):
                self.starting = {s for s in self.starting if s[:2] != (task, attempt)}
                self.supervised.add((task, attempt))
            case TaskReady(task_id=task, attempt=attempt):
                self.setting_up.discard((task, attempt))
            case StopConfirmed(task_id=task, attempt=attempt):
                self.stopping.discard((task, attempt))
            case TaskSetupFailed(task_id=task, attempt=attempt):
                self.setting_up.discard((task, attempt))
                self.starting = {s for s in self.starting if s[:2] != (task, attempt)}
            case TaskRunning(task_id=task, attempt=attempt):
                self.reported.add((task, attempt))
            case TaskEnded(task_id=task, attempt=attempt):
                self.supervised.discard((task, attempt))
            case TimerFired(task_id=task, attempt=attempt):
                self.timers.pop((task, attempt), None)


def stale_events(job: JobRecord) -> list[Event]:
    """Events about workers that do not exist or attempts that are over."""
    events: list[Event] = []
    for task, attempt in [("ghost-0", 0)] + [(t.id, t.attempt.number - 1) for t in job.tasks if t.attempt.number > 0]:
        events += [
            PlacementUpdate(task_id=task, attempt=attempt, node="n9"),
            PlacementUpdate(task_id=task, attempt=attempt, reason=Reason("NoMachineFits", "x")),
            TaskStarted(task_id=task, attempt=attempt),
            TaskSetupFailed(task_id=task, attempt=attempt, reason=Reason("ErrImagePull", "ErrImagePull: x")),
            TaskRunning(task_id=task, attempt=attempt),
            TaskEnded(task_id=task, attempt=attempt, exit_code=1),
            TimerFired(timer=Timer.RESTART, task_id=task, attempt=attempt),
        ]
    return events


Choice = tuple[int, int]
choices = st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 40)), max_size=40)


class Step(NamedTuple):
    """One decision of a played run: the record before, the event, the record after, what decide issued, when."""

    before: JobRecord
    event: Event
    after: JobRecord
    commands: list[Command]
    now: datetime


def played(job: JobRecord, picks: list[Choice]) -> Iterator[Step]:
    """Play the choices from a new run's record, each a decision.

    Along the way: decide never raises, and never changes the record it is given.
    """
    world, now = World(), T0
    job, commands = decide(job, [Created()], now)
    world.learn(commands)
    for pick, seconds in picks:
        options = world.options(job)
        if not options:
            break
        event = options[pick % len(options)]
        now += timedelta(seconds=seconds)
        if isinstance(event, TimerFired):
            now = max(now, world.timers[(event.task_id, event.attempt)])
        world.consume(event)
        before, dump = job, job.model_dump()
        job, commands = decide(job, [event], now)
        assert before.model_dump() == dump
        world.learn(commands)
        yield Step(before, event, job, commands, now)


def play(policy: str, picks: list[Choice], gang: bool = False) -> list[tuple[JobRecord, JobRecord]]:
    """Play the choices; return every (before, after) pair of records."""
    return [(step.before, step.after) for step in played(new_job(spec(policy, gang), SHRUNK, T0), picks)]


# Cancel while a worker waits out its back-off, then its restart timer fires.
BACKOFF_THEN_CANCEL: list[Choice] = [(0, 1), (0, 1), (0, 1), (0, 1), (0, 1), (5, 1), (1, 1), (6, 1), (3, 1), (0, 1)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(choices)
def test_with_restart_policy_never_nothing_leaves_a_terminal_run_state(picks: list[Choice]) -> None:
    for before, after in play("Never", picks):
        if before.state in RUN_TERMINAL:
            assert after.state == before.state


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(["OnFailure", "Always"]), choices)
@example("OnFailure", BACKOFF_THEN_CANCEL)
def test_with_restarts_nothing_leaves_a_terminal_run_state(policy: str, picks: list[Choice]) -> None:
    for before, after in play(policy, picks):
        if before.state in RUN_TERMINAL:
            assert after.state == before.state


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.sampled_from(["OnFailure", "Always", "Never"]), choices)
def test_decide_never_raises_on_events_about_unknown_workers_or_old_attempts(policy: str, picks: list[Choice]) -> None:
    for _, job in play(policy, picks):
        for event in stale_events(job):
            after, commands = decide(job, [event], job.status.created_at + timedelta(days=1))
            assert [t.model_dump() for t in after.tasks] == [t.model_dump() for t in job.tasks]
            expected = (
                [Release(task_id=event.task_id, attempt=event.attempt)]
                if isinstance(event, PlacementUpdate) and event.node
                else []
            )
            assert commands == expected


# The spec's run diagram (Starting is for gangs): consecutive run states are equal or one of these edges.
RUN_EDGES = {
    (RunState.PENDING, RunState.STARTING),
    (RunState.STARTING, RunState.RUNNING),
    (RunState.PENDING, RunState.RUNNING),
    (RunState.RUNNING, RunState.PENDING),
    (RunState.STARTING, RunState.PENDING),
    (RunState.RUNNING, RunState.COMPLETED),
    (RunState.RUNNING, RunState.FAILED),
    (RunState.STARTING, RunState.FAILED),
    (RunState.PENDING, RunState.FAILED),
    (RunState.RUNNING, RunState.CANCELLED),
    (RunState.PENDING, RunState.CANCELLED),
}
# Edges the diagram lacks, each a decision of workflows/README.md ("Decisions the spec leaves open"): a gang
# cancelled (or its members all stopped) at the barrier ends Cancelled from Starting.
DECIDED_EDGES = {(RunState.STARTING, RunState.CANCELLED)}
# Both workers start and exit 0 before either running report is handled.
ENDED_BEFORE_RUNNING: list[Choice] = [(0, 1), (0, 1), (0, 1), (0, 1), (1, 1), (1, 1)]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(choices)
@example(ENDED_BEFORE_RUNNING)
def test_with_restart_policy_never_the_run_history_follows_the_run_diagram(picks: list[Choice]) -> None:
    steps = play("Never", picks)
    if not steps:
        return
    states = [RunState(entry.state) for entry in steps[-1][1].history]
    moves = {(a, b) for a, b in itertools.pairwise(states) if a != b}
    assert moves <= RUN_EDGES


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from(["Never", "OnFailure"]), choices)
def test_a_gangs_run_history_follows_the_run_diagram(policy: str, picks: list[Choice]) -> None:
    steps = play(policy, picks, gang=True)
    if not steps:
        return
    states = [RunState(entry.state) for entry in steps[-1][1].history]
    moves = {(a, b) for a, b in itertools.pairwise(states) if a != b}
    assert moves <= RUN_EDGES | DECIDED_EDGES
