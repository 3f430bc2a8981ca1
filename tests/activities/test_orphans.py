"""The lease holder stops orphaned workers: those still running on the machine while their run's workflow is
closed, terminated (the Temporal UI's Terminate button) or gone, and writes each stop in the machine's history. Real
processes (the process runtime); the runs' and the machine's workflows are a scripted stand-in."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack, suppress
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from activities.agent import AgentActivities
from activities.agent.housekeeping import WATCHED_RUN_LOOKS
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import Launch
from activities.agent.runtime.process import ProcessRuntime
from workflows.domain.inventory import NodeInventory
from workflows.domain.machine.decisions import OrphanStopped
from workflows.domain.refs import TaskRef
from workflows.domain.run.events import ExitedWhileLost
from workflows.domain.settings import Settings
from workflows.messages import AttemptsOnNode, AttemptsQuery, LeaseInput, SuperviseInput


class Temporal:
    """What the agent's client reaches: each run's workflow as described (a status, or an RPCStatusCode it fails
    with), and the machine's workflow, which records the updates it takes (none while `refuse`)."""

    def __init__(
        self,
        runs: dict[str, WorkflowExecutionStatus | RPCStatusCode],
        attempts: dict[str, AttemptsOnNode] | None = None,
    ) -> None:
        self.runs = runs
        self.attempts = attempts or {}  # each open run's answer to `attempts_on`
        self.queried: list[str] = []
        self.signals: list[tuple[str, str, Any]] = []
        self.updates: list[tuple[str, str, Any]] = []
        self.refuse = False
        self.described: list[str] = []
        self.listed: list[str] = []  # visibility queries, which the agent should never make

    def list_workflows(self, query: str, page_size: int = 1000) -> AsyncIterator[SimpleNamespace]:
        self.listed.append(query)

        async def executions() -> AsyncIterator[SimpleNamespace]:
            for workflow_id, status in self.runs.items():
                if status == WorkflowExecutionStatus.RUNNING:
                    yield SimpleNamespace(id=workflow_id)

        return executions()

    def get_workflow_handle(self, workflow_id: str) -> Temporal._Handle:
        return Temporal._Handle(self, workflow_id)

    class _Handle:
        def __init__(self, owner: Temporal, workflow_id: str) -> None:
            self._owner, self._id = owner, workflow_id

        async def describe(self) -> SimpleNamespace:
            if self._id.startswith("node/"):  # the lease's renewal read back for the fence: no run is read
                raise RPCError(f"workflow {self._id}: not described here", RPCStatusCode.UNAVAILABLE, b"")
            self._owner.described.append(self._id)
            answer = self._owner.runs.get(self._id, RPCStatusCode.NOT_FOUND)
            if isinstance(answer, RPCStatusCode):
                raise RPCError(f"workflow {self._id}: {answer.name}", answer, b"")
            return SimpleNamespace(status=answer)

        async def signal(self, name: str, message: Any) -> None:
            if self._owner.refuse:
                raise RuntimeError("control plane unreachable")
            self._owner.signals.append((self._id, name, message))

        async def query(self, name: str, query: AttemptsQuery, result_type: type) -> AttemptsOnNode:
            assert (name, query, result_type) == ("attempts_on", AttemptsQuery(node="n0"), AttemptsOnNode)
            self._owner.queried.append(self._id)
            return self._owner.attempts[self._id]

        async def execute_update(self, name: str, message: Any, result_type: Any = None) -> None:
            if self._owner.refuse:
                raise RuntimeError("control plane unreachable")
            self._owner.updates.append((self._id, name, message))


class Machine:
    def __init__(self, root: Path, temporal: Temporal, settings: Settings) -> None:
        self.temporal = temporal
        self.runtime = ProcessRuntime(root / "tasks")
        inventory = NodeInventory(name="n0", cpus=8, memory_bytes=2**34)
        self.agent = AgentActivities(
            cast(Client, temporal), inventory, self.runtime, Preparer(root), None, None, settings=settings
        )
        self.beats: list[float] = []
        self._holding: asyncio.Future[None] | None = None

    def run(self, key: TaskRef, command: list[str] | None = None) -> TaskRef:
        self.runtime.start(key, Launch(command=command or ["sleep", "60"]))
        return key

    def runs(self, key: TaskRef) -> bool:
        return self.runtime.observe(key).running

    def hold_lease(self) -> None:
        environment = ActivityEnvironment()
        environment.on_heartbeat = lambda *_: self.beats.append(time.monotonic())
        self._holding = asyncio.ensure_future(
            environment.run(self.agent.hold_lease, LeaseInput(node="n0", renew_seconds=0.05))
        )

    async def release(self) -> None:
        if self._holding is not None:
            self._holding.cancel()
            with suppress(BaseException):
                await self._holding


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    runtime = ProcessRuntime(tmp_path / "tasks")
    for key in runtime.attempts():
        runtime.stop(key, grace_seconds=0)


async def until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


def key(job: str, task: str = "w-0", attempt: int = 0, namespace: str = "default") -> TaskRef:
    return TaskRef(namespace=namespace, job=job, task_id=task, attempt=attempt)


async def test_the_lease_holder_stops_workers_of_runs_no_longer_open_and_writes_why_in_the_machines_history(
    root: Path,
) -> None:
    temporal = Temporal(
        {
            "job/default/gone": WorkflowExecutionStatus.TERMINATED,
            "job/default/over": WorkflowExecutionStatus.COMPLETED,
            "job/team-a/alive": WorkflowExecutionStatus.RUNNING,
            "job/default/unread": RPCStatusCode.UNAVAILABLE,  # Temporal does not answer: looked at again later
        }
    )
    machine = Machine(root, temporal, Settings(orphan_check_seconds=0.1, stop_grace_seconds=0.5))
    gone = [machine.run(key("gone", "w-0")), machine.run(key("gone", "w-1", attempt=3))]
    over = machine.run(key("over"))
    deleted = machine.run(key("deleted"))  # its workflow does not exist (any more)
    alive = machine.run(key("alive", namespace="team-a"))
    unread = machine.run(key("unread"))
    temporal.refuse = True  # the machine's workflow does not take the first reports
    machine.hold_lease()
    try:
        await until(lambda: not any(machine.runs(k) for k in [*gone, over, deleted]))
        assert machine.runs(alive) and machine.runs(unread)
        await asyncio.sleep(0.3)
        assert temporal.updates == []
        temporal.refuse = False
        await until(lambda: len(temporal.updates) == 4)
        await asyncio.sleep(0.3)  # later looks find nothing more to stop, and tell nothing twice
        assert machine.runs(alive) and machine.runs(unread)
        assert temporal.described.count("job/default/unread") >= 2
    finally:
        await machine.release()
    assert temporal.updates == [
        ("node/n0", "report_orphan_stopped", OrphanStopped(task=task, run=run, status=status))
        for task, run, status in [
            ("w-0", "default/deleted", "not found"),
            ("w-0", "default/gone", "terminated"),
            ("w-1", "default/gone", "terminated"),
            ("w-0", "default/over", "completed"),
        ]
    ]


async def test_a_stop_that_waits_out_its_grace_never_holds_up_the_leases_heartbeats(root: Path) -> None:
    temporal = Temporal({"job/default/stubborn": WorkflowExecutionStatus.TERMINATED})
    machine = Machine(root, temporal, Settings(orphan_check_seconds=0.1, stop_grace_seconds=2))
    trapped = root / "trapped"
    # It ignores the stop signal, once its shell has set the trap (a stop before that would end it at once)
    stubborn = machine.run(key("stubborn"), ["sh", "-c", f"trap '' TERM; touch {trapped}; sleep 60"])
    await until(lambda: machine.runs(stubborn) and trapped.exists())  # on a busy machine its shim takes a moment
    machine.hold_lease()
    try:
        began = time.monotonic()
        await until(lambda: not machine.runs(stubborn))
        assert time.monotonic() - began >= 2  # killed once its grace ran out
        await until(lambda: len(temporal.updates) == 1)
    finally:
        await machine.release()
    gaps = [later - earlier for earlier, later in itertools.pairwise(machine.beats)]
    # Blocked by the stop, a gap would last the whole grace (2 s); 1 s leaves room for a loaded machine.
    assert len(machine.beats) >= 20 and max(gaps) < 1.0
    assert temporal.updates == [
        (
            "node/n0",
            "report_orphan_stopped",
            OrphanStopped(task="w-0", run="default/stubborn", status="terminated"),
        )
    ]


async def test_the_lease_holder_stops_attempts_their_open_run_no_longer_has_here_and_keeps_the_current_ones(
    root: Path,
) -> None:
    # Issue 11, finding 5: an abandoned start ran late, or a worker outlived a machine loss: its run is open but has
    # moved on, so the stale attempt would run beside the new one, holding GPUs the scheduler thinks free.
    temporal = Temporal(
        {"job/default/train": WorkflowExecutionStatus.RUNNING},
        {"job/default/train": AttemptsOnNode(open=True, attempts={"w-0": 2})},
    )
    machine = Machine(root, temporal, Settings(orphan_check_seconds=0.1, stop_grace_seconds=0.5))
    stale = machine.run(key("train", "w-0", attempt=1))  # the run has attempt 2 here now
    lost = machine.run(key("train", "w-1", attempt=0))  # the run has w-1 nowhere here (lost with the machine)
    current = machine.run(key("train", "w-0", attempt=2))
    machine.hold_lease()
    try:
        await until(lambda: not machine.runs(stale) and not machine.runs(lost))
        await until(lambda: len(temporal.updates) == 2)
        await asyncio.sleep(0.3)
        assert machine.runs(current)
    finally:
        await machine.release()
    assert temporal.updates == [
        ("node/n0", "report_orphan_stopped", OrphanStopped(task=task, run="default/train", status=why, attempt=a))
        for task, a, why in [
            ("w-0", 1, "its run has attempt 2 here now"),
            ("w-1", 0, "its run no longer has it on this machine"),
        ]
    ]


async def test_attempts_an_activity_of_the_agent_watches_are_not_asked_about(root: Path) -> None:
    temporal = Temporal({"job/default/train": WorkflowExecutionStatus.RUNNING}, {})
    machine = Machine(root, temporal, Settings(orphan_check_seconds=0.05))
    watched = machine.run(key("train"))
    with machine.agent._live_attempt(watched):  # as run_task or supervise_task holds it
        machine.hold_lease()
        try:
            await asyncio.sleep(0.3)
        finally:
            await machine.release()
    assert machine.runs(watched) and temporal.queried == [] and temporal.updates == []
    assert temporal.described == [] and temporal.listed == []  # watched: nothing to read


async def test_a_run_whose_workers_are_all_watched_is_read_once_every_few_looks(root: Path) -> None:
    # Asking about every run at every look (a describe each, then a visibility query per machine) cost a busy server
    # a slow read every 5 s per machine (bench/README.md). A run with an attempt no activity watches is read at every
    # look; one whose attempts are all watched, once every WATCHED_RUN_LOOKS looks: a watch sends no heartbeat
    # (protocol 7), so only a read learns that its run was terminated.
    running, terminated = WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.TERMINATED
    temporal = Temporal({"job/default/a": running, "job/default/b": terminated, "job/default/end": terminated})
    look = 0.05
    machine = Machine(root, temporal, Settings(orphan_check_seconds=look, stop_grace_seconds=0.5))
    alive, closed = (machine.run(key(job)) for job in ("a", "b"))
    ended = machine.run(key("end"))  # no activity watches it
    began = time.monotonic()
    with ExitStack() as stack:
        for attempt in (alive, closed):
            stack.enter_context(machine.agent._live_attempt(attempt))
        machine.hold_lease()
        try:
            await until(lambda: not machine.runs(ended))
            first = time.monotonic() - began
            await until(lambda: not machine.runs(closed))
            second = time.monotonic() - began
            await asyncio.sleep(10 * look)  # more looks
        finally:
            await machine.release()
        elapsed = time.monotonic() - began
    assert machine.runs(alive)
    assert first < WATCHED_RUN_LOOKS * look <= second  # the unwatched one at the first look, the watched later
    assert 1 <= temporal.described.count("job/default/a") <= elapsed / (WATCHED_RUN_LOOKS * look) + 1
    assert temporal.listed == []
    assert [u[2] for u in temporal.updates] == [
        OrphanStopped(task="w-0", run="default/end", status="terminated"),
        OrphanStopped(task="w-0", run="default/b", status="terminated"),
    ]


async def test_a_worker_whose_watch_ended_before_it_did_and_that_exited_0_is_told_to_its_run(root: Path) -> None:
    # Issue 11, finding 8: the run lost the worker with the machine (its watch was cancelled) while the worker went
    # on and exited 0; its exit, kept on the machine, is read back and told, so finished work is not run again.
    temporal = Temporal({"job/default/train": WorkflowExecutionStatus.RUNNING}, {})
    machine = Machine(root, temporal, Settings(orphan_check_seconds=0.05))
    done, failed = key("train", "w-0", attempt=2), key("train", "w-1")
    for worker, code in ((done, 0), (failed, 3)):
        machine.run(worker, ["sh", "-c", f"sleep 0.5; exit {code}"])
        watch = ActivityEnvironment()
        ref = worker
        watching = asyncio.ensure_future(
            watch.run(machine.agent.supervise_task, SuperviseInput(ref=ref, settings=Settings()))
        )
        await until(lambda w=worker: any(s[2].task_id == w.task_id for s in temporal.signals))  # type: ignore[misc]
        watch.cancel()  # the run lost it with the machine
        with suppress(BaseException):
            await watching
    temporal.signals.clear()
    temporal.refuse = True  # the run does not hear the first tries
    machine.hold_lease()
    try:
        await until(lambda: not machine.runs(done) and not machine.runs(failed))
        await asyncio.sleep(0.2)
        temporal.refuse = False
        await told_once_that_w0_exited(temporal)
    finally:
        await machine.release()


async def test_an_agent_started_again_tells_exits_its_former_process_never_read_and_stops_what_runs_no_longer_have(
    root: Path,
) -> None:
    # Issue 11, finding 8, for an agent process killed and started again: its former process watched these workers;
    # the new one knows them only from the machine. One exited 0 a moment ago, one long ago (its run heard it
    # then), one failed; one still runs though its run has closed. Before the machine takes work again, the new
    # process stops the last one, and tells the recent exit 0 to its run (which ignores it unless it lost it).
    temporal = Temporal(
        {"job/default/train": WorkflowExecutionStatus.RUNNING, "job/default/over": WorkflowExecutionStatus.COMPLETED}
    )
    former = Machine(root, temporal, Settings())
    recent, old, failed = key("train", "w-0", attempt=2), key("train", "w-1"), key("train", "w-2")
    for worker, code in ((recent, 0), (old, 0), (failed, 3)):
        former.run(worker, ["sh", "-c", f"exit {code}"])
    stray = former.run(key("over"))
    await until(lambda: not any(former.runs(k) for k in (recent, old, failed)))
    long_ago = time.time() - 3600
    os.utime(root / "tasks" / old.slug / "exit", (long_ago, long_ago))

    again = Machine(root, temporal, Settings(orphan_check_seconds=0.05))  # the new process, before it registers
    assert await again.agent.adopt_attempts() == 2  # the recent exit, and the one still running
    assert not again.runs(stray)
    assert temporal.signals == []  # told once registered: its registration waits for nothing
    again.hold_lease()
    try:
        await told_once_that_w0_exited(temporal)
    finally:
        await again.release()


async def told_once_that_w0_exited(temporal: Temporal) -> None:
    """The run heard, once, that its worker w-0 (attempt 2) exited 0 while its machine was lost."""
    await until(lambda: len(temporal.signals) == 1)
    await asyncio.sleep(0.2)  # told once
    assert temporal.signals == [
        ("job/default/train", "task_exited_while_lost", ExitedWhileLost(task_id="w-0", attempt=2, node="n0"))
    ]
