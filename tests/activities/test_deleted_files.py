"""A deleted run's files leave the machine: `delete_run_files` (a delete reaching the machine) stops what still runs
and removes every attempt of the run, its log and files included; and an agent that comes back removes the attempts
of runs deleted while it was away, and no others. Real processes (the process runtime); Temporal is a stand-in."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from activities.agent import AgentActivities
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import Launch
from activities.agent.runtime.process import ProcessRuntime
from workflows.domain.inventory import NodeInventory
from workflows.domain.refs import TaskRef
from workflows.domain.settings import Settings
from workflows.domain.tombstones import Tombstone
from workflows.messages import AttemptsOnNode, DeletedFiles, DeleteRunFilesInput, TombstonesQuery

AT = datetime(2026, 1, 1, tzinfo=UTC)


class Temporal:
    """Each run's workflow (its status and run id, or absent), each open run's `attempts_on` answer, and the
    tombstones DeletedRunsWorkflow keeps."""

    def __init__(self, runs: dict[str, tuple[WorkflowExecutionStatus, str]], tombstones: list[Tombstone]) -> None:
        self.runs = runs
        self.tombstones = tombstones
        self.attempts: dict[str, AttemptsOnNode] = {}

    def get_workflow_handle(self, workflow_id: str) -> Any:
        owner = self

        class Handle:
            async def describe(self) -> SimpleNamespace:
                if workflow_id not in owner.runs:
                    raise RPCError(f"workflow {workflow_id}: not found", RPCStatusCode.NOT_FOUND, b"")
                status, run_id = owner.runs[workflow_id]
                return SimpleNamespace(status=status, run_id=run_id)

            async def query(self, name: str, asked: Any, result_type: Any) -> Any:
                if name == "tombstones":
                    assert workflow_id == "deleted-runs" and isinstance(asked, TombstonesQuery)
                    wanted = set(asked.runs or [])
                    return [t for t in owner.tombstones if (t.namespace, t.name) in wanted]
                assert name == "attempts_on"
                return owner.attempts[workflow_id]

        return Handle()


def tombstone(name: str, run_id: str) -> Tombstone:
    return Tombstone(namespace="default", name=name, run_id=run_id, deleted_by="ann", deleted_at=AT,
                     last_state="Cancelled")  # fmt: skip


def key(job: str, task: str = "w-0", attempt: int = 0) -> TaskRef:
    return TaskRef(namespace="default", job=job, task_id=task, attempt=attempt)


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    runtime = ProcessRuntime(tmp_path / "tasks")
    for k in runtime.attempts():
        runtime.stop(k, grace_seconds=0)


def agent(root: Path, temporal: Temporal) -> tuple[AgentActivities, ProcessRuntime]:
    runtime = ProcessRuntime(root / "tasks")
    inventory = NodeInventory(name="n0", cpus=8, memory_bytes=2**34)
    settings = Settings(stop_grace_seconds=0.5)
    made = AgentActivities(cast(Client, temporal), inventory, runtime, Preparer(root), None, None, settings=settings)
    return made, runtime


async def test_a_delete_reaching_the_machine_stops_and_removes_every_attempt_of_the_run_and_no_other(
    root: Path,
) -> None:
    machine, runtime = agent(root, Temporal({}, []))
    running = key("gone", "w-0", attempt=1)
    runtime.start(running, Launch(command=["sleep", "60"]))
    ended = key("gone", "w-1")
    runtime.start(ended, Launch(command=["true"]))
    other = key("kept")
    runtime.start(other, Launch(command=["sleep", "60"]))
    config = root / "config" / running.slug
    config.mkdir(parents=True)
    (config / "token").write_text("secret")

    done = await ActivityEnvironment().run(machine.delete_run_files, DeleteRunFilesInput(namespace="default",
                                                                                        job="gone"))  # fmt: skip
    assert done == DeletedFiles(attempts=2)
    assert runtime.attempts() == [other] and runtime.observe(other).running
    assert not config.exists()
    again = await ActivityEnvironment().run(machine.delete_run_files, DeleteRunFilesInput(namespace="default",
                                                                                         job="gone"))  # fmt: skip
    assert again == DeletedFiles(attempts=0)


async def test_an_agent_that_comes_back_removes_the_attempts_of_runs_deleted_while_it_was_away(root: Path) -> None:
    temporal = Temporal(
        {
            "job/default/reused": (WorkflowExecutionStatus.RUNNING, "new"),  # a new run took the name
            "job/default/closing": (WorkflowExecutionStatus.CANCELED, "old"),  # Temporal has not removed it yet
            "job/default/ended": (WorkflowExecutionStatus.COMPLETED, "later"),  # reused, and ended: not deleted
            "job/default/alive": (WorkflowExecutionStatus.RUNNING, "only"),  # never deleted
        },
        [tombstone("gone", "a"), tombstone("reused", "b"), tombstone("closing", "old"), tombstone("ended", "c")],
    )
    temporal.attempts["job/default/reused"] = AttemptsOnNode(open=True, attempts={"w-1": 0})
    machine, runtime = agent(root, temporal)
    removed = [key("gone"), key("reused", "w-0"), key("closing")]
    kept = [key("reused", "w-1"), key("ended"), key("alive")]
    for k in [*removed, *kept]:
        runtime.start(k, Launch(command=["sleep", "60"]))

    assert await machine.remove_deleted_runs() == 3
    assert runtime.attempts() == sorted(kept, key=lambda k: k.slug)
    assert all(runtime.observe(k).running for k in kept)
