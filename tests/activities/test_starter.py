"""Starting a worker: GPU admission with health, a setup that waits and reports, stops during setup, and the gang
barrier (set up without starting, GPUs held until the start or a stop). Real processes (the process runtime); the
run that would hear the reports is a list."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

import pytest

from activities.agent.node_network import NodeNetworkUp
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import Launch, Observed, OnProgress, ignore_progress
from activities.agent.runtime.process import ProcessRuntime
from activities.agent.starter import SetupEnded, Starter, bindable
from workflows.domain.inventory import GpuInfo, PortRange
from workflows.domain.reasons import Reason
from workflows.domain.refs import TaskRef
from workflows.domain.spec import GroupSpec

T = TypeVar("T")


def key(task: str = "w-0", attempt: int = 1) -> TaskRef:
    return TaskRef(namespace="team-a", job="llm", task_id=task, attempt=attempt)


def group(**fields: Any) -> GroupSpec:
    return GroupSpec.model_validate({"name": "w", "command": ["sh", "-c", "sleep 30"], **fields})


def gpu(index: int, fault: str | None = None, at_risk: str | None = None) -> GpuInfo:
    return GpuInfo(index=index, uuid=f"GPU-{index}", model="H100", memory_bytes=80 << 30, fault=fault, at_risk=at_risk)


class Machine:
    """A Starter over real processes, and what it reported."""

    def __init__(self, root: Path, gpus: list[GpuInfo]) -> None:
        self.root = root
        self.runtime = ProcessRuntime(root / "tasks")
        self.gpus = gpus
        self.reported: list[tuple[str, str]] = []
        self.beats: list[str] = []
        self.starter = Starter(self.runtime, Preparer(root), lambda: self.gpus, self.report, retry_seconds=0.05)

    async def report(self, task_key: TaskRef, reason: Reason) -> None:
        self.reported.append((task_key.task_id, reason.text))

    async def start(self, task_key: TaskRef, spec: GroupSpec) -> list[int]:
        return await self.starter.start(task_key, spec, {}, self.beats.append)


@pytest.fixture
def machine(tmp_path: Path) -> Iterator[Machine]:
    m = Machine(tmp_path, [gpu(0), gpu(1, at_risk="retired pages pending"), gpu(2, fault="Xid 79"), gpu(3)])
    yield m
    for directory in (tmp_path / "tasks").glob("*"):
        for name, kill in (("pid", os.killpg), ("shim.pid", os.kill)):
            with suppress(FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
                kill(int((directory / name).read_text()), signal.SIGKILL)


async def test_gpus_are_given_healthy_first_then_at_risk_never_faulted(machine: Machine) -> None:
    assert await machine.start(key("a"), group(gpus=2)) == [0, 3]
    assert await machine.start(key("b"), group(gpus=1)) == [1]
    with pytest.raises(SetupEnded) as ended:
        await machine.start(key("c"), group(gpus=1))

    assert ended.value.reason.text == "Container start failed: needs 1 GPUs, 0 free on this machine"
    assert machine.runtime.gpus_in_use() == {key("a").slug: [0, 3], key("b").slug: [1]}


async def test_a_plain_worker_s_setup_hands_to_threads_only_the_look_at_held_gpus_and_its_start(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker with no drive, secret or registry credential, on a runtime without images, has nothing to prepare or
    pull that could block: that part of its setup runs on the event loop. In a burst each hand-off to a thread
    costs the agent CPU (bench/README.md)."""
    handed: list[str] = []
    to_thread, loop = asyncio.to_thread, asyncio.get_running_loop()
    run_in_executor = loop.run_in_executor

    async def counted_to_thread(function: Any, /, *args: Any) -> Any:
        handed.append(function.__name__)
        return await to_thread(function, *args)

    def counted_executor(executor: Any, function: Any, *args: Any) -> Any:
        if executor is not None:  # the starter's own threads (asyncio.to_thread, counted above, uses the default)
            handed.append("its own threads")
        return run_in_executor(executor, function, *args)

    monkeypatch.setattr(asyncio, "to_thread", counted_to_thread)
    monkeypatch.setattr(loop, "run_in_executor", counted_executor)
    assert await machine.start(key(), group(gpus=1)) == [0]

    assert handed == ["gpus_in_use", "its own threads"]  # the start
    assert machine.runtime.observe(key()).running


async def test_a_launch_the_runtime_cannot_run_ends_the_setup_before_its_start(machine: Machine) -> None:
    spec = group(drives=[{"name": "data", "volume": "data", "mount_path": "/data"}])
    with pytest.raises(SetupEnded) as ended:
        await machine.start(key(), spec)

    error = "the process runtime cannot mount drives or files (/data); run it on a docker machine"
    assert ended.value.reason.text == f"Invalid task: {error}"
    assert machine.runtime.attempts() == []


async def test_a_retried_start_finds_the_attempt_it_started(machine: Machine) -> None:
    first = await machine.start(key(), group(gpus=1))

    assert await machine.start(key(), group(gpus=1)) == first
    assert [k.slug for k in machine.runtime.attempts()] == [key().slug]


async def started_across_a_look(
    runtime: ProcessRuntime, look: str, monkeypatch: pytest.MonkeyPatch, start: Callable[[TaskRef], Awaitable[T]]
) -> tuple[T, T]:
    """Start attempts a and b, b's look at what runs (the runtime's method `look`) beginning before a's start ends
    and returning after it: a is neither running in that look nor still being set up after it."""
    runtime_start, looked = runtime.start, getattr(runtime, look)
    starting, start_may_go, second_look, look_may_end = (threading.Event() for _ in range(4))
    looks = 0

    def held_start(*args: Any) -> None:
        starting.set()
        start_may_go.wait(10)
        runtime_start(*args)

    def late_look() -> Any:
        nonlocal looks
        looks += 1
        held = looked()
        if looks == 2:
            second_look.set()
            look_may_end.wait(10)
        return held

    monkeypatch.setattr(runtime, "start", held_start)
    monkeypatch.setattr(runtime, look, late_look)
    first = asyncio.ensure_future(start(key("a")))
    await asyncio.to_thread(starting.wait, 10)
    second = asyncio.ensure_future(start(key("b")))
    await asyncio.to_thread(second_look.wait, 10)
    start_may_go.set()
    a = await first
    look_may_end.set()
    return a, await second


async def test_a_start_that_ends_while_another_attempt_is_admitted_keeps_its_gpu(
    machine: Machine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It must still count as holding GPU 0 (a burst of 1,000 runs once gave one GPU to two workers)."""
    gpus_in_use = machine.runtime.gpus_in_use

    assert await started_across_a_look(
        machine.runtime, "gpus_in_use", monkeypatch, lambda k: machine.start(k, group(gpus=1))
    ) == ([0], [3])
    assert gpus_in_use() == {key("a").slug: [0], key("b").slug: [3]}


async def test_a_setup_that_waits_reports_once_and_starts_when_ready(machine: Machine) -> None:
    spec = group(command=["sh", "-c", 'echo "$HF_TOKEN"'], secrets=[{"name": "hf", "key": "token", "env": "HF_TOKEN"}])
    starting = asyncio.ensure_future(machine.start(key(), spec))
    await asyncio.sleep(0.3)
    assert not starting.done()
    assert machine.reported == [("w-0", "waiting for external secret hf (key token) to be synced to this node")]
    assert set(machine.beats) == {machine.reported[0][1]}

    (machine.root / "secrets" / "hf").mkdir(parents=True)
    (machine.root / "secrets" / "hf" / "token").write_text("hf_abc")
    await asyncio.wait_for(starting, 5)

    assert len(machine.reported) == 1
    while machine.runtime.observe(key()).running:
        await asyncio.sleep(0.02)
    assert machine.runtime.log_tail(key(), 5, 100) == "hf_abc\n"


async def test_a_retry_does_not_report_again_what_was_reported(machine: Machine) -> None:
    spec = group(secrets=[{"name": "hf", "key": "token", "env": "HF_TOKEN"}])
    reason = "waiting for external secret hf (key token) to be synced to this node"
    starting = asyncio.ensure_future(machine.starter.start(key(), spec, {}, machine.beats.append, reported=reason))
    await asyncio.sleep(0.2)
    starting.cancel()

    assert machine.reported == []


async def test_a_stop_during_setup_ends_it_and_nothing_starts(machine: Machine) -> None:
    spec = group(gpus=1, secrets=[{"name": "hf", "key": "token", "env": "HF_TOKEN"}])
    starting = asyncio.ensure_future(machine.start(key(), spec))
    await asyncio.sleep(0.2)

    await machine.starter.stop(key(), grace_seconds=1)

    with pytest.raises(SetupEnded) as ended:
        await asyncio.wait_for(starting, 5)
    assert ended.value.reason.text == "Stopped on request"
    assert machine.runtime.observe(key()) == Observed(running=False, not_found=True)
    assert await machine.start(key("next"), group(gpus=3)) == [0, 1, 3]  # its GPU was given back


async def test_a_stop_before_the_start_arrives_keeps_it_from_starting(machine: Machine) -> None:
    await machine.starter.stop(key(), grace_seconds=1)

    with pytest.raises(SetupEnded, match=r"^Stopped on request$"):
        await machine.start(key(), group())


async def test_a_task_the_runtime_refuses_ends_its_setup_with_the_runtimes_reason(machine: Machine) -> None:
    spec = group(gpus=1, drives=[{"name": "cache", "volume": "cache", "mount_path": "/cache"}])

    with pytest.raises(SetupEnded) as ended:
        await machine.start(key(), spec)

    assert ended.value.reason.text == (
        "Invalid task: the process runtime cannot mount drives or files (/cache); run it on a docker machine"
    )
    assert await machine.start(key("next"), group(gpus=3)) == [0, 1, 3]


# ---- the gang barrier: set up without starting, GPUs held until the start or a stop -----------------------------


async def test_a_barrier_setup_prepares_without_starting_and_the_start_keeps_its_gpus(machine: Machine) -> None:
    secrets = [{"name": "hf", "key": "token", "env": "HF_TOKEN"}]
    spec = group(gpus=2, command=["sh", "-c", 'echo "$HF_TOKEN"; sleep 30'], secrets=secrets)
    (machine.root / "secrets" / "hf").mkdir(parents=True)
    (machine.root / "secrets" / "hf" / "token").write_text("hf_abc")

    assert await machine.starter.ready(key(), spec, {}, machine.beats.append) == ([0, 3], False, None)
    assert machine.runtime.observe(key()) == Observed(running=False, not_found=True)
    # Nothing runs, yet its GPUs are held: another attempt gets the at-risk one, not the held ones.
    assert await machine.start(key("other"), group(gpus=1)) == [1]
    with pytest.raises(SetupEnded, match=r"^Container start failed: needs 1 GPUs, 0 free on this machine$"):
        await machine.start(key("third"), group(gpus=1))

    assert await machine.start(key(), spec) == [0, 3]
    assert machine.runtime.observe(key()).running
    assert machine.runtime.gpus_in_use()[key().slug] == [0, 3]
    assert machine.reported == []  # ready at once: no wait, and a process has no image to pull


async def test_a_repeated_barrier_call_answers_the_same_and_reports_nothing_twice(machine: Machine) -> None:
    spec = group(gpus=1, secrets=[{"name": "hf", "key": "token", "env": "HF_TOKEN"}])
    waiting = asyncio.ensure_future(machine.starter.ready(key(), spec, {}, machine.beats.append))
    await asyncio.sleep(0.2)
    (machine.root / "secrets" / "hf").mkdir(parents=True)
    (machine.root / "secrets" / "hf" / "token").write_text("hf_abc")
    first = await asyncio.wait_for(waiting, 5)

    again = await machine.starter.ready(key(), spec, {}, machine.beats.append, reported=machine.beats[-1])

    assert first == again == ([0], False, None)
    assert machine.reported == [("w-0", "waiting for external secret hf (key token) to be synced to this node")]
    assert machine.runtime.attempts() == []


async def test_a_barrier_call_after_the_start_says_it_started(machine: Machine) -> None:
    await machine.starter.ready(key(), group(gpus=1), {}, machine.beats.append)
    await machine.start(key(), group(gpus=1))

    assert await machine.starter.ready(key(), group(gpus=1), {}, machine.beats.append) == ([0], True, None)


async def test_a_stop_at_the_barrier_gives_its_gpus_back_and_it_never_starts(machine: Machine) -> None:
    assert await machine.starter.ready(key(), group(gpus=3), {}, machine.beats.append) == ([0, 1, 3], False, None)

    await machine.starter.stop(key(), grace_seconds=1)

    assert await machine.start(key("next"), group(gpus=3)) == [0, 1, 3]
    with pytest.raises(SetupEnded, match=r"^Stopped on request$"):
        await machine.start(key(), group(gpus=3))
    assert machine.runtime.observe(key()) == Observed(running=False, not_found=True)


async def test_a_stop_during_the_barrier_setup_ends_it_and_gives_its_gpus_back(machine: Machine) -> None:
    spec = group(gpus=3, secrets=[{"name": "hf", "key": "token", "env": "HF_TOKEN"}])
    waiting = asyncio.ensure_future(machine.starter.ready(key(), spec, {}, machine.beats.append))
    await asyncio.sleep(0.2)

    await machine.starter.stop(key(), grace_seconds=1)

    with pytest.raises(SetupEnded, match=r"^Stopped on request$"):
        await asyncio.wait_for(waiting, 5)
    assert await machine.start(key("next"), group(gpus=3)) == [0, 1, 3]


async def test_starts_wait_on_threads_of_their_own_not_on_the_shared_pool(tmp_path: Path) -> None:
    """A start mostly waits (fork, exec, the shim's own start). START_THREADS starts of one machine wait at once,
    each blocked until all are under way: on the shared default pool (6 threads on 2 cores) the last of them would
    queue behind the first, as a burst's starts did for longer than a run's heartbeat timeout."""
    import threading

    from activities.agent.starter import START_THREADS

    all_under_way = threading.Barrier(START_THREADS, timeout=10)

    class Waiting(ProcessRuntime):
        def start(self, *args: Any, **kwargs: Any) -> None:
            all_under_way.wait()
            super().start(*args, **kwargs)

    m = Machine(tmp_path, [])
    m.runtime = Waiting(tmp_path / "tasks")
    m.starter = Starter(m.runtime, Preparer(tmp_path), lambda: [], m.report, retry_seconds=0.05)
    try:
        keys = [key(f"w-{i}") for i in range(START_THREADS)]
        await asyncio.wait_for(asyncio.gather(*(m.start(k, group(command=["sleep", "30"])) for k in keys)), 30)
        assert sorted(k.slug for k in m.runtime.attempts()) == sorted(k.slug for k in keys)
    finally:
        for k in m.runtime.attempts():
            m.runtime.stop(k, grace_seconds=0)


class Recording(ProcessRuntime):
    """The process runtime, keeping each Launch it is handed (what the docker runtime would be handed too)."""

    launches: list[Launch]

    def start(self, key: TaskRef, launch: Launch, on_progress: OnProgress = ignore_progress) -> None:
        self.launches = [*getattr(self, "launches", []), launch]
        super().start(key, launch, on_progress)


async def test_a_worker_with_memory_per_gpu_is_launched_with_its_gpus_times_it(tmp_path: Path) -> None:
    runtime = Recording(tmp_path / "tasks")

    async def report(task_key: TaskRef, reason: Reason) -> None:
        pass

    starter = Starter(runtime, Preparer(tmp_path), lambda: [gpu(0), gpu(1), gpu(3)], report, retry_seconds=0.05)
    try:
        await starter.start(key(), group(gpus=2, per_gpu={"memory_bytes": 48 << 20}), {}, lambda _: None)
        assert [launch.memory_bytes for launch in runtime.launches] == [96 << 20]
    finally:
        runtime.stop(key(), grace_seconds=0)


def serving(ports: str) -> GroupSpec:
    """A worker with external access that stays up, each port named as given ("web:8080,api:9090")."""
    access = [{"name": n, "port": int(p)} for n, p in (item.split(":") for item in ports.split(","))]
    return group(external_access=access)


def free_range(size: int) -> PortRange:
    """`size` ports in a row that nothing on this machine holds now."""
    for first in range(41000, 60000, 97):
        if all(bindable(p) for p in range(first, first + size)):
            return PortRange(first=first, last=first + size - 1)
    raise AssertionError("no free ports here")


def ported(root: Path, ports: PortRange, runtime: ProcessRuntime | None = None) -> tuple[Starter, list[str]]:
    reported: list[str] = []

    async def report(task_key: TaskRef, reason: Reason) -> None:
        reported.append(f"{task_key.task_id}: {reason.text}")

    runtime = runtime or ProcessRuntime(root / "tasks")
    return Starter(runtime, Preparer(root), lambda: [], report, retry_seconds=0.05, ports=ports), reported


def environment(runtime: ProcessRuntime, task_key: TaskRef) -> dict[str, str]:
    variables = Path(f"/proc/{(runtime.root / task_key.slug / 'pid').read_text().strip()}/environ").read_bytes()
    pairs = (item.partition("=") for item in variables.decode().split("\0") if item)
    return {k: v for k, _, v in pairs if k.startswith("ASTRAEUS_") and "PORT" in k}


async def test_external_access_gets_ports_of_the_range_that_no_live_worker_holds(tmp_path: Path) -> None:
    ports = free_range(3)
    starter, _ = ported(tmp_path, ports)
    runtime = ProcessRuntime(tmp_path / "tasks")
    try:
        await starter.start(key("a"), serving("web:8080,api:9090"), {}, lambda _: None)
        await starter.start(key("b"), serving("web:8080"), {}, lambda _: None)
        first = ports.first
        assert runtime.ports_in_use() == {
            key("a").slug: {"web": first, "api": first + 1},
            key("b").slug: {"web": first + 2},
        }
        # A process listens on the machine's port itself: both variables name it.
        assert environment(runtime, key("b")) == {
            "ASTRAEUS_EXTERNAL_PORT_WEB": str(first + 2),
            "ASTRAEUS_PORT_WEB": str(first + 2),
        }
    finally:
        for task in ("a", "b"):
            runtime.stop(key(task), grace_seconds=0)


async def test_a_start_that_ends_while_another_attempt_takes_ports_keeps_its_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As with GPUs: the first, running, holds its port; the second must not be given it."""
    ports = free_range(2)
    runtime = ProcessRuntime(tmp_path / "tasks")
    starter, _ = ported(tmp_path, ports, runtime)
    ports_in_use = runtime.ports_in_use
    try:
        await started_across_a_look(
            runtime, "ports_in_use", monkeypatch, lambda k: starter.start(k, serving("web:8080"), {}, lambda _: None)
        )

        assert ports_in_use() == {key("a").slug: {"web": ports.first}, key("b").slug: {"web": ports.last}}
    finally:
        for task in ("a", "b"):
            runtime.stop(key(task), grace_seconds=0)


async def test_a_worker_waits_for_its_port_until_one_is_free_and_an_agent_that_restarts_keeps_them(
    tmp_path: Path,
) -> None:
    ports = free_range(1)
    starter, _ = ported(tmp_path, ports)
    runtime = ProcessRuntime(tmp_path / "tasks")
    try:
        await starter.start(key("a"), serving("web:8080"), {}, lambda _: None)
        # A new agent over the same machine (it restarted): the port is held by the worker that runs.
        again, reported = ported(tmp_path, ports)
        waiting = asyncio.ensure_future(again.start(key("b"), serving("web:8080"), {}, lambda _: None))
        await asyncio.sleep(0.5)
        assert (waiting.done(), reported) == (False, ["b: Waiting for its external port to be assigned"])
        runtime.stop(key("a"), grace_seconds=0)
        await asyncio.wait_for(waiting, 10)
        assert runtime.ports_in_use() == {key("b").slug: {"web": ports.first}}
    finally:
        for task in ("a", "b"):
            runtime.stop(key(task), grace_seconds=0)


async def test_a_port_another_program_holds_is_never_assigned(tmp_path: Path) -> None:
    ports = free_range(2)
    starter, _ = ported(tmp_path, ports)
    runtime = ProcessRuntime(tmp_path / "tasks")
    with socket.socket() as other:
        other.bind(("0.0.0.0", ports.first))
        other.listen()
        try:
            await starter.start(key("a"), serving("web:8080"), {}, lambda _: None)
            assert runtime.ports_in_use() == {key("a").slug: {"web": ports.last}}
        finally:
            runtime.stop(key("a"), grace_seconds=0)


async def test_external_access_on_a_machine_without_a_range_cannot_start(tmp_path: Path) -> None:
    runtime = ProcessRuntime(tmp_path / "tasks")

    async def report(task_key: TaskRef, reason: Reason) -> None:
        pass

    starter = Starter(runtime, Preparer(tmp_path), lambda: [], report, retry_seconds=0.05)
    with pytest.raises(SetupEnded) as ended:
        await starter.start(key("a"), serving("web:8080"), {}, lambda _: None)
    assert ended.value.reason.text == (
        "Container start failed: external_access needs ports, and this machine's agent has no --external-ports range"
    )


class Networked(Recording):
    """A runtime that makes node networks (as the docker runtime does), recording its launches."""

    def node_network(self, subnet: str) -> str:
        return "astraeus-node-m1"


async def test_a_mesh_worker_waits_for_the_node_network_then_joins_it_under_its_name(tmp_path: Path) -> None:
    runtime = Networked(tmp_path / "tasks")
    reported: list[str] = []
    network: list[NodeNetworkUp] = []

    async def report(task_key: TaskRef, reason: Reason) -> None:
        reported.append(reason.text)

    starter = Starter(
        runtime,
        Preparer(tmp_path),
        lambda: [],
        report,
        retry_seconds=0.05,
        node_network=lambda: next(iter(network), None),
    )
    try:
        waiting = asyncio.ensure_future(
            starter.start(key(), group(network={"mesh": True}), {}, lambda _: None, None, True)
        )
        await asyncio.sleep(0.3)
        assert (waiting.done(), reported) == (False, ["Waiting for the node network (subnet assignment and mesh)"])
        network.append(NodeNetworkUp(name="astraeus-node-m1", subnet="10.200.3.0/24"))
        await asyncio.wait_for(waiting, 10)
        [launch] = runtime.launches
        # A gang member's host network gives way: the worker has an address of its own on the subnet.
        assert (launch.network, launch.network_alias, launch.host_network) == (
            "astraeus-node-m1",
            "w-0.llm.team-a",
            False,
        )
        assert (launch.env["ASTRAEUS_NODE_SUBNET"], launch.env["ASTRAEUS_NODE_HOSTNAME"]) == (
            "10.200.3.0/24",
            "w-0.llm.team-a",
        )
    finally:
        runtime.stop(key(), grace_seconds=0)


async def test_a_mesh_worker_on_a_machine_without_the_node_network_cannot_start(tmp_path: Path) -> None:
    async def report(task_key: TaskRef, reason: Reason) -> None:
        pass

    starter = Starter(ProcessRuntime(tmp_path / "tasks"), Preparer(tmp_path), lambda: [], report, retry_seconds=0.05)
    with pytest.raises(SetupEnded) as ended:
        await starter.start(key(), group(network={"mesh": True}), {}, lambda _: None)
    assert ended.value.reason.text == (
        "Container start failed: network.mesh: its workers run as processes on the machine's own network; the node "
        "network needs the docker runtime, whose workers join a network with the machine's subnet"
    )
