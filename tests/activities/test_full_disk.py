"""A full disk never turns an exit into a re-run (issue 39): the shim keeps a record it cannot write (pid, oom, exit)
and writes it again until it can, the attempt reads running meanwhile (never "Container not found on the node"), the
agent's log says why once, and the machine shows disk pressure. The runtime's root is on a tiny tmpfs, filled."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.agent import AgentActivities
from activities.agent.machine import PressureWatch
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import Launch, Observed
from activities.agent.runtime.process import ProcessRuntime
from activities.agent.runtime.shim import held, record, write_atomically
from tests.activities.runtimes import kill_attempts, wait_until_ended
from tests.activities.test_agent import Runs, group, ref
from workflows.domain.inventory import NodeInventory
from workflows.domain.refs import TaskRef
from workflows.domain.settings import Settings
from workflows.messages import StartTaskInput, SuperviseInput

# ---- the shim's retry, through its seams ---------------------------------------------------------------------------


def test_a_record_that_cannot_be_written_is_kept_and_written_again_backing_off_and_named_meanwhile() -> None:
    attempts: list[str] = []
    slept: list[float] = []
    names: list[str] = []
    holding: list[bool] = []

    def full_three_times(path: str, text: str) -> None:
        attempts.append(text)
        if len(attempts) <= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    written = record(
        "/attempt/exit", "0\n", holding=lambda: holding.append(True), write=full_three_times,
        sleep=slept.append, name=names.append,
    )  # fmt: skip

    assert written
    assert attempts == ["0\n"] * 4
    assert slept == [1.0, 2.0, 4.0]
    assert names == ["held exit 28", "astraeus-shim"]
    assert holding == [True]  # once: the agent need not wait for the worker's start


def test_a_record_backs_off_to_five_seconds_and_says_each_new_reason() -> None:
    errors = [errno.ENOSPC] * 5 + [errno.EDQUOT, errno.EIO]
    slept: list[float] = []
    names: list[str] = []

    def failing(path: str, text: str) -> None:
        if errors:
            number = errors.pop(0)
            raise OSError(number, os.strerror(number))

    assert record("/attempt/oom", "1\n", write=failing, sleep=slept.append, name=names.append)
    assert slept == [1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0]
    assert names == [f"held oom {errno.ENOSPC}", f"held oom {errno.EDQUOT}", f"held oom {errno.EIO}", "astraeus-shim"]


def test_a_pid_no_longer_needed_is_given_up() -> None:
    def full(path: str, text: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert not record("/attempt/pid", "7\n", given_up=lambda: True, write=full, sleep=lambda _: None, name=print)


def test_a_shim_s_name_says_what_it_holds() -> None:
    assert held("held exit 28") == ("exit", 28)
    assert held("python3") is None
    assert held("held exit x") is None


# ---- a tiny filesystem that fills up ------------------------------------------------------------------------------


class Disk:
    """A tmpfs of 256 KiB at `path`, which `fill` fills to the last byte and `free` empties again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._filler = path / "filler"

    def fill(self) -> None:
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"x" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def free(self) -> None:
        self._filler.unlink()


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Disk]:
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)]
    mounted = subprocess.run(mount, capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield Disk(mount_point)
    finally:
        kill_attempts(mount_point / "tasks")  # by pid: their shims work in it, and a busy mount stays mounted
        deadline = time.monotonic() + 5
        while subprocess.run(["umount", str(mount_point)], capture_output=True).returncode != 0:
            if time.monotonic() > deadline:
                subprocess.run(["umount", "--lazy", str(mount_point)], check=True)
                break
            time.sleep(0.05)


def until_held(runtime: ProcessRuntime, key: TaskRef, seconds: float = 5.0) -> Observed:
    deadline = time.monotonic() + seconds
    while (observed := runtime.observe(key)).held is None:
        assert observed.running, f"ended while the disk was full: {observed}"
        assert time.monotonic() < deadline, "its shim never said it holds its exit"
        time.sleep(0.02)
    return observed


def test_a_failed_write_leaves_no_temporary_file(disk: Disk) -> None:
    disk.fill()
    with pytest.raises(OSError) as failed:
        write_atomically(disk.path / "exit", "0\n")
    assert failed.value.errno == errno.ENOSPC
    assert sorted(os.listdir(disk.path)) == ["filler"]


def test_a_worker_that_exits_0_on_a_full_disk_runs_until_there_is_room_then_exits_0(disk: Disk, tmp_path: Path) -> None:
    runtime = ProcessRuntime(disk.path / "tasks")
    release = tmp_path / "release"  # off the full disk
    key = ref()
    runtime.start(key, Launch(command=["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.02; done"]))
    disk.fill()
    release.touch()

    observed = until_held(runtime, key)
    assert observed.running and observed.exit_code is None and not observed.not_found
    assert observed.held is not None
    assert (observed.held.record, observed.held.error) == ("exit", "No space left on device")
    assert observed.held.filesystem == str(disk.path)
    restarted = ProcessRuntime(disk.path / "tasks")  # an agent that restarted finds it the same way
    assert restarted.observe(key).held == observed.held
    time.sleep(1.2)  # the shim tried again at least once
    assert runtime.observe(key).running
    assert not (disk.path / "tasks" / key.slug / "exit").exists()
    runtime.stop(key, grace_seconds=0)  # its worker ended: nothing to signal, nothing to wait for

    disk.free()
    assert wait_until_ended(runtime, key, seconds=10) == Observed(running=False, exit_code=0)
    assert restarted.observe(key) == Observed(running=False, exit_code=0)


async def test_the_agent_says_once_why_a_worker_s_exit_is_kept_and_its_run_hears_exit_0(
    disk: Disk, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    inventory = NodeInventory(name="n0", cpus=8, memory_bytes=64 << 30)
    runtime = ProcessRuntime(disk.path / "tasks")
    agent = AgentActivities(cast(Client, Runs()), inventory, runtime, Preparer(tmp_path / "agent"))
    release = tmp_path / "release"
    command = ["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.02; done"]
    settings = Settings(stale_grace_seconds=0.4, orphan_check_seconds=0.1)  # a heartbeat and a look each 0.1 s
    caplog.set_level(logging.WARNING, logger="activities.agent.attempts")

    await ActivityEnvironment().run(agent.start_task, StartTaskInput(ref=ref(), group=group(command=command)))
    supervised = SuperviseInput(ref=ref(), settings=settings, readiness=None)
    watch = asyncio.ensure_future(ActivityEnvironment().run(agent.supervise_task, supervised))
    disk.fill()
    release.touch()
    await asyncio.sleep(1.5)  # many looks
    assert not watch.done()
    disk.free()

    assert (await asyncio.wait_for(watch, 10)).exit_code == 0
    said = [r.getMessage() for r in caplog.records if "kept until there is room" in r.getMessage()]
    directory = disk.path / "tasks" / ref().slug
    assert said == [
        f"{ref().slug}: w-0 exited but its exit cannot be written to {directory} (filesystem {disk.path}): "
        "No space left on device; kept until there is room"
    ]


def test_a_full_data_dir_shows_disk_pressure(disk: Disk, tmp_path: Path) -> None:
    procfs = tmp_path / "proc"
    procfs.mkdir()
    (procfs / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 900 kB\n")
    watch = PressureWatch(disk.path / "data", procfs)  # a data dir not made yet: its filesystem's
    assert watch.poll() == []
    disk.fill()
    assert watch.poll() == ["disk"]
    disk.free()
    assert watch.poll(["disk"]) == []
