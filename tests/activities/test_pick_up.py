"""The agent tells a run when its machine picked a worker up: in the one report that it started and runs when the
start is quick (no signal more), at once when setting it up takes a while (a wait, a pull, or over a second)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.agent import AgentActivities
from activities.agent.attempts import PICK_UP_REPORT_SECONDS
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import Launch, OnProgress
from activities.agent.runtime.process import ProcessRuntime
from tests.activities.test_agent import Machine, group, ref
from workflows.domain.inventory import NodeInventory
from workflows.domain.reasons import Reason
from workflows.domain.refs import TaskRef
from workflows.domain.run.events import TaskProgress, TaskRunning
from workflows.domain.settings import Settings
from workflows.messages import RunTaskInput, StartTaskInput


class SlowStart(ProcessRuntime):
    """A runtime whose start takes longer than PICK_UP_REPORT_SECONDS (an engine under load, a big image)."""

    def start(self, key: TaskRef, launch: Launch, progress: OnProgress) -> None:
        time.sleep(PICK_UP_REPORT_SECONDS + 0.5)
        super().start(key, launch, progress)


def run_task(machine: Machine, **fields: Any) -> asyncio.Future[Any]:
    message = RunTaskInput(start=StartTaskInput(ref=ref(), group=group(**fields)), settings=Settings())
    return asyncio.ensure_future(ActivityEnvironment().run(machine.agent.run_task, message))


def told(machine: Machine) -> list[tuple[str, Any]]:
    return [(name, message) for _, name, message in machine.runs.signals]


async def test_a_quick_start_is_told_once_with_when_it_was_picked_up_and_started(tmp_path: Path) -> None:
    machine = Machine(tmp_path)
    before = datetime.now(UTC)
    ended = await run_task(machine, command=["true"])
    after = datetime.now(UTC)
    assert ended.exit_code == 0
    [(name, report)] = told(machine)
    assert name == "task_running"
    assert isinstance(report, TaskRunning) and report.started
    assert report.picked_up_at is not None and report.started_at is not None
    assert before <= report.picked_up_at <= report.started_at <= after


async def test_a_slow_start_is_told_picked_up_while_it_is_set_up(tmp_path: Path) -> None:
    machine = Machine(tmp_path)
    inventory = NodeInventory(name="n0", cpus=8, memory_bytes=64 << 30)
    machine.agent = AgentActivities(
        cast(Client, machine.runs), inventory, SlowStart(tmp_path / "tasks"), Preparer(tmp_path)
    )
    ended = await run_task(machine, command=["true"])
    assert ended.exit_code == 0
    (progress_name, progress), (running_name, running) = told(machine)
    assert (progress_name, running_name) == ("task_progress", "task_running")
    assert progress == TaskProgress(
        task_id="w-0",
        attempt=1,
        reason=Reason("PickedUp", "Picked up by n0"),
        picked_up_at=running.picked_up_at,
    )
    assert running.started_at is not None and running.picked_up_at is not None
    assert (running.started_at - running.picked_up_at).total_seconds() >= PICK_UP_REPORT_SECONDS


async def test_a_wait_is_told_with_when_it_was_picked_up_and_no_pick_up_report_more(tmp_path: Path) -> None:
    machine = Machine(tmp_path)
    running = run_task(machine, command=["true"], secrets=[{"name": "hf", "key": "token", "env": "HF"}])
    await asyncio.sleep(PICK_UP_REPORT_SECONDS + 0.5)
    token = tmp_path / "secrets" / "hf" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("x")
    assert (await running).exit_code == 0
    names = [name for name, _ in told(machine)]
    assert names == ["task_progress", "task_running"]
    wait, report = told(machine)[0][1], told(machine)[1][1]
    assert wait.reason.text == "waiting for external secret hf (key token) to be synced to this node"
    assert wait.picked_up_at == report.picked_up_at is not None
