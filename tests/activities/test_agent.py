"""The agent's activities at the gang barrier and with readiness checks, over real processes (the process runtime):
`start_task` with `barrier` sets up without starting and holds the GPUs; the run's variables reach the worker;
`supervise_task` tells the run its worker's health when it changes. The runs that hear the signals are a list."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import resource
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from datetime import timedelta
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
from workflows.domain.group_parts import Readiness
from workflows.domain.inventory import GpuInfo, NodeInventory
from workflows.domain.refs import TaskRef
from workflows.domain.run.events import TaskHealth, TaskRunning
from workflows.domain.settings import Settings
from workflows.domain.spec import GroupSpec, job_id
from workflows.messages import StartTaskInput, StartTaskResult, StopTaskInput, SuperviseInput, TaskExit


class Runs:
    """What the agent's client reaches: each run's workflow, which only records the signals it is sent. A signal
    that names a workflow run in `closed` is refused, as the server refuses one to a run that continued as new."""

    def __init__(self) -> None:
        self.signals: list[tuple[str, str, Any]] = []  # (workflow id, signal, message)
        self.run_ids: list[str | None] = []  # the workflow run each signal named, None for the current one
        self.closed: set[str] = set()

    def get_workflow_handle(self, workflow_id: str, run_id: str | None = None) -> _Handle:
        return _Handle(self, workflow_id, run_id)

    def health(self) -> list[tuple[bool, str]]:
        return [(m.healthy, m.detail) for _, name, m in self.signals if name == "task_health"]


class _Handle:
    def __init__(self, runs: Runs, workflow_id: str, run_id: str | None) -> None:
        self._runs, self._id, self._run_id = runs, workflow_id, run_id

    async def signal(self, name: str, message: Any) -> None:
        if self._run_id in self._runs.closed:
            raise RPCError("workflow execution already completed", RPCStatusCode.NOT_FOUND, b"")
        self._runs.signals.append((self._id, name, message))
        self._runs.run_ids.append(self._run_id)


class Machine:
    def __init__(self, root: Path) -> None:
        self.runs = Runs()
        self.runtime = ProcessRuntime(root / "tasks")
        gpus = [GpuInfo(index=i, uuid=f"GPU-{i}", model="H100", memory_bytes=80 << 30) for i in range(2)]
        inventory = NodeInventory(name="n0", cpus=8, memory_bytes=64 << 30, gpus=gpus)
        self.agent = AgentActivities(cast(Client, self.runs), inventory, self.runtime, Preparer(root))


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    yield Machine(tmp_path)
    for directory in (tmp_path / "tasks").glob("*"):
        for name, kill in (("pid", os.killpg), ("shim.pid", os.kill)):
            with suppress(FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
                kill(int((directory / name).read_text()), signal.SIGKILL)


def ref(task: str = "w-0", attempt: int = 1) -> TaskRef:
    return TaskRef(namespace="team-a", job="serve", task_id=task, attempt=attempt)


def group(**fields: Any) -> GroupSpec:
    return GroupSpec.model_validate({"name": "w", "command": ["sleep", "30"], **fields})


def ready_file_check(**fields: Any) -> Readiness:
    """Passes while the file `ready` exists in the worker's directory (its working directory)."""
    return Readiness.model_validate({"command": ["test", "-f", "ready"], "period_seconds": 0.05, **fields})


async def start(machine: Machine, spec: GroupSpec, task: str = "w-0", **fields: Any) -> StartTaskResult:
    """The start's result, less when the machine picked the worker up (tests/activities/test_pick_up.py)."""
    result = await ActivityEnvironment().run(
        machine.agent.start_task, StartTaskInput(ref=ref(task), group=spec, **fields)
    )
    assert result.picked_up_at is not None
    return result.model_copy(update={"picked_up_at": None})


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


def supervise(machine: Machine, readiness: Readiness, reattach: bool = False) -> asyncio.Future[TaskExit]:
    supervised = SuperviseInput(ref=ref(), settings=Settings(), reattach=reattach, readiness=readiness)
    return asyncio.ensure_future(ActivityEnvironment().run(machine.agent.supervise_task, supervised))


# ---- start_task at the barrier --------------------------------------------------------------------------------------


async def test_a_barrier_start_sets_up_without_starting_then_the_start_runs_it_with_the_runs_variables(
    machine: Machine,
) -> None:
    show = 'echo "$MODEL $MASTER_ADDR $RANK $ASTRAEUS_NODE $ASTRAEUS_GROUP"'
    spec = group(gpus=1, command=["sh", "-c", show], env={"MODEL": "7b", "MASTER_ADDR": "group"})
    run_env = {"MASTER_ADDR": "10.0.0.5", "RANK": "3", "ASTRAEUS_NODE": "not-this-one"}

    assert await start(machine, spec, barrier=True, env=run_env) == StartTaskResult(gpu_indices=[0], started=False)
    assert machine.runtime.observe(ref()) == Observed(running=False, not_found=True)

    assert await start(machine, spec, env=run_env) == StartTaskResult(gpu_indices=[0], started=True)
    await until(lambda: machine.runtime.observe(ref()).exit_code == 0)
    assert machine.runtime.log_tail(ref(), 5, 1024) == "7b 10.0.0.5 3 n0 w\n"


async def test_the_gpus_held_at_the_barrier_are_given_back_by_a_stop(machine: Machine) -> None:
    assert await start(machine, group(gpus=2), barrier=True) == StartTaskResult(gpu_indices=[0, 1], started=False)
    with pytest.raises(ApplicationError) as refused:
        await start(machine, group(gpus=1), task="w-1")
    assert refused.value.message == "Container start failed: needs 1 GPUs, 0 free on this machine"

    await ActivityEnvironment().run(machine.agent.stop_task, StopTaskInput(ref=ref(), grace_seconds=1))

    assert await start(machine, group(gpus=2), task="w-1") == StartTaskResult(gpu_indices=[0, 1])
    with pytest.raises(ApplicationError) as refused:
        await start(machine, group(gpus=2))
    assert (refused.value.type, refused.value.message) == ("StoppedOnRequest", "Stopped on request")


# ---- supervise_task with a readiness check ------------------------------------------------------------------------


async def test_health_is_told_first_and_then_only_when_it_changes(machine: Machine) -> None:
    await start(machine, group())
    ready = machine.runtime.root / ref().slug / "ready"
    supervising = supervise(machine, ready_file_check())

    await until(lambda: len(machine.runs.health()) == 1)
    await asyncio.sleep(0.3)  # several checks fail alike: told once
    ready.touch()
    await until(lambda: len(machine.runs.health()) == 2)
    await asyncio.sleep(0.3)
    ready.unlink()
    await until(lambda: len(machine.runs.health()) == 3)
    await ActivityEnvironment().run(machine.agent.stop_task, StopTaskInput(ref=ref(), grace_seconds=1))

    assert (await asyncio.wait_for(supervising, 5)).exit_code == 143
    assert machine.runs.health() == [
        (False, "exited with code 1"),
        (True, "exited with code 0"),
        (False, "exited with code 1"),
    ]
    names = [(workflow_id, name) for workflow_id, name, _ in machine.runs.signals]
    assert names == [("job/team-a/serve", "task_running")] + [("job/team-a/serve", "task_health")] * 3
    assert machine.runs.signals[1][2] == TaskHealth(
        task_id="w-0", attempt=1, healthy=False, detail="exited with code 1"
    )


async def test_a_supervisor_that_reattaches_tells_the_health_again(machine: Machine) -> None:
    await start(machine, group())
    (machine.runtime.root / ref().slug / "ready").touch()
    first = supervise(machine, ready_file_check())
    await until(lambda: len(machine.runs.health()) == 1)
    first.cancel()

    again = supervise(machine, ready_file_check(), reattach=True)
    await until(lambda: len(machine.runs.health()) == 2)

    assert machine.runs.health() == [(True, "exited with code 0")] * 2
    assert machine.runs.signals[-2][1:] == ("task_running", TaskRunning(task_id="w-0", attempt=1, heartbeat=True))
    again.cancel()
    with suppress(BaseException):
        await asyncio.gather(first, again)


async def test_a_slow_check_never_delays_the_heartbeats(machine: Machine) -> None:
    await start(machine, group())
    beats: list[float] = []
    supervised = SuperviseInput(
        ref=ref(),
        settings=Settings(stale_grace_seconds=1),
        readiness=Readiness(command=["sleep", "10"], period_seconds=0.05, timeout_seconds=1.5),
    )
    environment = beating(timedelta(seconds=1))
    environment.on_heartbeat = lambda *_: beats.append(time.monotonic())
    supervising = asyncio.ensure_future(environment.run(machine.agent.supervise_task, supervised))

    await until(lambda: len(machine.runs.health()) == 1, seconds=5)
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]

    assert machine.runs.health() == [(False, "timed out after 1.5s")]
    assert len(beats) >= 3 and max(gaps) < 0.5  # from 0.75 s, a quarter of the grace (0.25 s) while the check hangs
    await ActivityEnvironment().run(machine.agent.stop_task, StopTaskInput(ref=ref(), grace_seconds=1))
    await asyncio.wait_for(supervising, 5)


async def test_a_watch_sends_its_first_heartbeat_three_intervals_in_then_one_each_interval(machine: Machine) -> None:
    # The SDK sends an activity's first heartbeat at once: a burst's starts would each cost the server a write
    await start(machine, group())
    beats: list[float] = []
    supervised = SuperviseInput(ref=ref(), settings=Settings(stale_grace_seconds=2))  # an interval of 0.5 s
    environment = beating(timedelta(seconds=2))
    environment.on_heartbeat = lambda *_: beats.append(time.monotonic())
    began = time.monotonic()
    supervising = asyncio.ensure_future(environment.run(machine.agent.supervise_task, supervised))
    await asyncio.sleep(2.5)
    assert beats and 1.5 <= beats[0] - began < 2.0  # three quarters of the grace: the last quarter for it to arrive
    assert len(beats) >= 2 and max(later - earlier for earlier, later in itertools.pairwise(beats)) < 1.0
    await ActivityEnvironment().run(machine.agent.stop_task, StopTaskInput(ref=ref(), grace_seconds=1))
    await asyncio.wait_for(supervising, 5)


def beating(timeout: timedelta) -> ActivityEnvironment:
    """An activity environment as a run from before protocol 7 gave a watch: with a heartbeat timeout."""
    environment = ActivityEnvironment()
    environment.info = dataclasses.replace(environment.info, heartbeat_timeout=timeout)
    return environment


async def test_a_watch_without_a_heartbeat_timeout_sends_no_heartbeat(machine: Machine) -> None:
    """Protocol 7: its machine's lease carries the worker's liveness; its watch reports its start and end only."""
    await start(machine, group())
    beats: list[float] = []
    supervised = SuperviseInput(ref=ref(), settings=Settings(stale_grace_seconds=1))  # an interval of 0.25 s
    environment = ActivityEnvironment()
    environment.on_heartbeat = lambda *_: beats.append(time.monotonic())
    supervising = asyncio.ensure_future(environment.run(machine.agent.supervise_task, supervised))
    await asyncio.sleep(1.5)
    assert beats == []
    running = [m for _, name, m in machine.runs.signals if name == "task_running"]
    assert running == [TaskRunning(**ref().ids())]  # told running all the same
    await ActivityEnvironment().run(machine.agent.stop_task, StopTaskInput(ref=ref(), grace_seconds=1))
    assert (await asyncio.wait_for(supervising, 5)).exit_code is not None


async def test_a_newer_watch_of_an_attempt_ends_the_one_before(machine: Machine) -> None:
    """Its run continued as new, or attached its watch again: the watch before, which no one awaits, ends."""
    await start(machine, group())
    supervised = SuperviseInput(ref=ref(), settings=Settings())
    first = asyncio.ensure_future(ActivityEnvironment().run(machine.agent.supervise_task, supervised))
    await asyncio.sleep(0.3)
    second = asyncio.ensure_future(ActivityEnvironment().run(machine.agent.supervise_task, supervised))
    with pytest.raises(ApplicationError, match="a newer watch took over") as ended:
        await asyncio.wait_for(first, 5)
    assert ended.value.type == "Superseded"
    assert not second.done()
    await ActivityEnvironment().run(machine.agent.stop_task, StopTaskInput(ref=ref(), grace_seconds=1))
    assert (await asyncio.wait_for(second, 5)).exit_code is not None


async def test_a_worker_without_a_readiness_check_is_never_told_healthy(machine: Machine) -> None:
    await start(machine, group(command=["sh", "-c", "sleep 0.3"]))
    supervised = SuperviseInput(ref=ref(), settings=Settings())

    assert (await ActivityEnvironment().run(machine.agent.supervise_task, supervised)).exit_code == 0
    assert [name for _, name, _ in machine.runs.signals] == ["task_running"]


async def test_a_worker_s_run_is_told_by_the_workflow_run_it_belongs_to_else_by_its_id(machine: Machine) -> None:
    # Named by its run, a signal needs no look-up of the current run on the server (bench/README.md)
    await start(machine, group())
    environment = ActivityEnvironment()
    environment.info = dataclasses.replace(
        environment.info, workflow_id=job_id("team-a", "serve"), workflow_run_id="r1"
    )
    watched = SuperviseInput(ref=ref(), settings=Settings())
    first = asyncio.ensure_future(environment.run(machine.agent.supervise_task, watched))
    await until(lambda: len(machine.runs.signals) == 1)
    first.cancel()

    machine.runs.closed.add("r1")  # the run continued as new: its activity tells the run that goes on
    again = asyncio.ensure_future(environment.run(machine.agent.supervise_task, watched))
    await until(lambda: len(machine.runs.signals) == 2)

    assert machine.runs.run_ids == ["r1", None]
    assert [(workflow_id, name) for workflow_id, name, _ in machine.runs.signals] == [
        ("job/team-a/serve", "task_running")
    ] * 2
    await ActivityEnvironment().run(machine.agent.stop_task, StopTaskInput(ref=ref(), grace_seconds=1))
    with suppress(BaseException):
        await asyncio.gather(first, again)


# ---- watching a worker ----------------------------------------------------------------------------------------------


def _counting_looks(machine: Machine) -> list[float]:
    """When the runtime is looked at (`observe`), from now on."""
    looks: list[float] = []
    observe = machine.runtime.observe

    def counted(key: Any) -> Observed:
        looks.append(time.monotonic())
        return observe(key)

    machine.runtime.observe = counted  # type: ignore[method-assign]
    return looks


async def test_a_worker_this_agent_started_is_watched_without_polling_and_its_end_told_at_once(
    machine: Machine,
) -> None:
    """The watch wakes when the worker's shim exits (a pidfd), not every quarter second: a worker that runs 1.5 s
    is looked at a few times, not six, and its end is seen within moments."""
    await start(machine, group(command=["sleep", "1.5"]))
    looks = _counting_looks(machine)
    supervised = SuperviseInput(ref=ref(), settings=Settings(), reattach=False, readiness=None)
    began = time.monotonic()
    ended = await ActivityEnvironment().run(machine.agent.supervise_task, supervised)
    assert ended.exit_code == 0
    assert len(looks) <= 3, f"looked {len(looks)} times"
    assert looks[-1] - began < 2.5


async def test_a_watched_worker_that_lives_on_is_not_looked_at_each_heartbeat(machine: Machine) -> None:
    """While its shim lives (its pidfd not readable) there is nothing to look at: a worker that lives ten heartbeat
    intervals is looked at once, when it ended (not when the watch begins either: its pidfd says it lives)."""
    await start(machine, group(command=["sleep", "1"]))
    looks = _counting_looks(machine)
    supervised = SuperviseInput(ref=ref(), settings=Settings(stale_grace_seconds=0.4), readiness=None)  # 0.1 s apart
    ended = await ActivityEnvironment().run(machine.agent.supervise_task, supervised)
    assert ended.exit_code == 0
    assert len(looks) == 1, f"looked {len(looks)} times"


async def test_an_agent_holding_descriptors_past_select_s_limit_watches_its_workers(machine: Machine) -> None:
    """An agent of many workers holds descriptors past select's 1,024 (a pidfd and a socket or two for each): its
    watch tells the run the worker runs, then sees it end, all the same."""
    await start(machine, group(command=["sleep", "0.5"]))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048 and (hard == resource.RLIM_INFINITY or hard >= 2048):
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))  # room for them wherever the tests run
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        supervised = SuperviseInput(ref=ref(), settings=Settings(), readiness=None)
        ended = await ActivityEnvironment().run(machine.agent.supervise_task, supervised)
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert ended.exit_code == 0
    assert [name for _, name, _ in machine.runs.signals] == ["task_running"]


def test_the_process_runtime_hands_a_descriptor_readable_once_the_attempt_ended(machine: Machine) -> None:
    import select

    from activities.agent.runtime.base import Launch

    runtime = machine.runtime
    key = ref()
    assert runtime.ended_fd(key) is None  # never started here
    runtime.start(key, Launch(command=["sleep", "30"]))
    fd = runtime.ended_fd(key)
    assert fd is not None
    try:
        assert select.select([fd], [], [], 0.2)[0] == []
        runtime.stop(key, grace_seconds=1)
        assert select.select([fd], [], [], 5)[0] == [fd]
    finally:
        os.close(fd)
    assert runtime.ended_fd(key) is None  # ended: nothing to wait for
