"""Fencing (issue 11, finding 5): a start that may be stale asks its run whether the attempt is still the run's on
this machine and is refused otherwise, starting nothing; a fresh first start asks nothing. Real processes (the
process runtime); the runs are a scripted stand-in answering the query `attempts_on`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from activities.agent import AgentActivities
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import Observed
from activities.agent.runtime.process import ProcessRuntime
from tests.activities.runtimes import kill_attempts
from workflows.domain.inventory import NodeInventory, NodeState, NodeView
from workflows.domain.refs import TaskRef
from workflows.domain.settings import Settings
from workflows.domain.spec import GroupSpec
from workflows.messages import AttemptsOnNode, AttemptsQuery, RunTaskInput, StartTaskInput

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


class Runs:
    """Each run's answer to `attempts_on` (a run missing here does not exist); records the queries and signals."""

    def __init__(self, answers: dict[str, AttemptsOnNode]) -> None:
        self.answers = answers
        self.queries: list[tuple[str, AttemptsQuery]] = []
        self.signals: list[tuple[str, str]] = []

    def get_workflow_handle(self, workflow_id: str) -> _Handle:
        return _Handle(self, workflow_id)


class _Handle:
    def __init__(self, runs: Runs, workflow_id: str) -> None:
        self._runs, self._id = runs, workflow_id

    async def query(self, name: str, query: AttemptsQuery, result_type: type) -> AttemptsOnNode:
        assert (name, result_type) == ("attempts_on", AttemptsOnNode)
        self._runs.queries.append((self._id, query))
        if self._id not in self._runs.answers:
            raise RPCError(f"workflow {self._id} not found", RPCStatusCode.NOT_FOUND, b"")
        return self._runs.answers[self._id]

    async def signal(self, name: str, message: Any) -> None:
        self._runs.signals.append((self._id, name))


class Machine:
    def __init__(self, root: Path, runs: Runs) -> None:
        self.runs = runs
        self.runtime = ProcessRuntime(root / "tasks")
        inventory = NodeInventory(name="n0", cpus=8, memory_bytes=64 << 30)
        self.agent = AgentActivities(cast(Client, runs), inventory, self.runtime, Preparer(root))


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    kill_attempts(tmp_path / "tasks")


def ref(attempt: int = 3) -> TaskRef:
    return TaskRef(namespace="default", job="train", task_id="w-0", attempt=attempt)


def start_input(attempt: int = 3) -> StartTaskInput:
    spec = GroupSpec.model_validate({"name": "w", "command": ["sleep", "30"]})
    return StartTaskInput(ref=ref(attempt), group=spec)


def environment(attempt: int = 1, scheduled: datetime = NOW, started: datetime = NOW) -> ActivityEnvironment:
    """An activity try: its attempt (a Temporal retry past 1), when it was scheduled and when it began."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(
        env.info, attempt=attempt, current_attempt_scheduled_time=scheduled, started_time=started
    )
    return env


def nothing_started(machine: Machine, attempt: int = 3) -> bool:
    return machine.runtime.observe(ref(attempt)) == Observed(running=False, not_found=True)


@pytest.mark.parametrize(
    ("answers", "why"),
    [
        ({"job/default/train": AttemptsOnNode(open=True, attempts={"w-0": 4})}, "its run has attempt 4 here now"),
        ({"job/default/train": AttemptsOnNode(open=True, attempts={})}, "its run no longer has it on this machine"),
        ({"job/default/train": AttemptsOnNode(open=False, attempts={"w-0": 3})}, "its run ended"),
        ({}, "its run no longer exists"),
    ],
    ids=["the run moved on to a new attempt", "the run lost it with the machine", "the run ended", "the run is gone"],
)
async def test_a_retried_start_whose_attempt_its_run_abandoned_is_refused_and_starts_nothing(
    root: Path, answers: dict[str, AttemptsOnNode], why: str
) -> None:
    machine = Machine(root, Runs(answers))
    with pytest.raises(ApplicationError) as refused:
        await environment(attempt=2).run(machine.agent.start_task, start_input())
    assert (refused.value.type, refused.value.message, refused.value.non_retryable) == (
        "StartRefused",
        f"Start refused: attempt 3 of worker w-0 is no longer its run's ({why})",
        True,
    )
    assert machine.runs.queries == [("job/default/train", AttemptsQuery(node="n0"))]
    assert nothing_started(machine)


async def test_a_run_task_scheduled_before_the_agent_registered_again_is_asked_about_and_refused(root: Path) -> None:
    # The machine was declared lost while this start waited in its queue; the agent came back and registered.
    machine = Machine(root, Runs({"job/default/train": AttemptsOnNode(open=True, attempts={})}))
    machine.agent.registered(NodeView(name="n0", state=NodeState.READY, since=NOW))
    settings = Settings()
    run = RunTaskInput(start=start_input(), settings=settings)
    with pytest.raises(ApplicationError) as refused:
        await environment(scheduled=NOW - timedelta(seconds=40), started=NOW).run(machine.agent.run_task, run)
    assert refused.value.type == "StartRefused"
    assert nothing_started(machine)


async def test_a_start_that_waited_in_its_queue_longer_than_a_lease_is_asked_about(root: Path) -> None:
    machine = Machine(root, Runs({"job/default/train": AttemptsOnNode(open=True, attempts={"w-0": 5})}))
    late = environment(scheduled=NOW - timedelta(seconds=31), started=NOW)  # the lease's TTL is 30 s
    with pytest.raises(ApplicationError):
        await late.run(machine.agent.start_task, start_input())
    assert nothing_started(machine)


async def test_a_doubtful_start_its_run_still_has_starts(root: Path) -> None:
    machine = Machine(root, Runs({"job/default/train": AttemptsOnNode(open=True, attempts={"w-0": 3})}))
    await environment(attempt=2).run(machine.agent.start_task, start_input())
    assert machine.runtime.observe(ref()).running
    assert len(machine.runs.queries) == 1


async def test_a_fresh_first_start_asks_its_run_nothing(root: Path) -> None:
    machine = Machine(root, Runs({}))  # a query would refuse it: the run does not exist
    machine.agent.registered(NodeView(name="n0", state=NodeState.READY, since=NOW - timedelta(seconds=5)))
    await environment().run(machine.agent.start_task, start_input())
    assert machine.runtime.observe(ref()).running
    assert machine.runs.queries == []


async def test_a_start_whose_lease_changed_while_it_was_set_up_is_asked_again_just_before_the_runtime_starts_it(
    root: Path,
) -> None:
    machine = Machine(root, Runs({"job/default/train": AttemptsOnNode(open=True, attempts={"w-0": 4})}))
    agent = machine.agent
    prepare = agent._starter._prepare  # the lease is lost and taken again while it is prepared

    async def prepared_across_a_lost_lease(*args: Any) -> Any:
        agent.registered(NodeView(name="n0", state=NodeState.READY, since=NOW))
        return await prepare(*args)

    agent._starter._prepare = prepared_across_a_lost_lease  # type: ignore[method-assign]
    with pytest.raises(ApplicationError) as refused:
        await environment().run(agent.start_task, start_input())
    assert refused.value.type == "StartRefused"
    assert nothing_started(machine)
    assert agent._starter.attempts.gpus_held() == {}  # its GPUs (none here) are given back
