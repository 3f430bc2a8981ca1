"""The process runtime limits a worker's memory to its `memory_bytes` with a cgroup of its own, made before the
command runs and removed once it ended; a worker the kernel killed for memory is seen as OOM-killed, by this agent or
one that restarted. Against the real kernel: as root these tests need memory cgroups and fail without them (CI runs
as root); they are skipped only for a user who is not root (the fixture memory_cgroups in tests/conftest.py)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from activities.agent.runtime.base import Launch, Observed, RuntimeFailure
from activities.agent.runtime.cgroups import MemoryCgroups, Unenforced, find_memory_cgroups
from activities.agent.runtime.process import ProcessRuntime
from tests.activities.runtimes import has_ended, kill_attempts, wait_until_ended
from workflows.domain.refs import TaskRef

MIB = 1 << 20
GREEDY = [sys.executable, "-c", "b = bytearray(256 << 20); print('survived')"]  # 256 MiB, touched


def key(attempt: int = 0) -> TaskRef:
    return TaskRef(namespace="team-a", job="mem", task_id="w-0", attempt=attempt)


def limit_of(cgroup: Path) -> int:
    name = "memory.limit_in_bytes" if (cgroup / "memory.limit_in_bytes").exists() else "memory.max"
    return int((cgroup / name).read_text())


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """The runtime's root; every worker and shim started under it is killed by pid afterwards, and every cgroup
    left behind removed."""
    yield tmp_path / "attempts"
    kill_attempts(tmp_path / "attempts")
    leftover = ProcessRuntime(tmp_path / "attempts", Unenforced("cleaning up"))
    for attempt in leftover.attempts():
        with suppress(ValueError):  # still seen running: its cgroup stays (the test failed already)
            leftover.delete(attempt)


@pytest.fixture
def runtime(root: Path, memory_cgroups: MemoryCgroups) -> ProcessRuntime:
    return ProcessRuntime(root, memory_cgroups)


def test_a_small_program_runs_under_a_limit_of_one_megabyte(runtime: ProcessRuntime) -> None:
    """The limit is the worker's alone: the shim forks itself to start it, and joins the cgroup only just before
    exec, so the forked interpreter's pages never count against it (they would be OOM-killed under 1 MB)."""
    runtime.start(key(), Launch(command=["sh", "-c", "echo small"], memory_bytes=1_000_000))

    assert wait_until_ended(runtime, key()) == Observed(running=False, exit_code=0, oom=False)
    assert runtime.log_tail(key(), 50, 16384) == "small\n"


def test_a_worker_over_its_memory_bytes_is_oom_killed_and_its_cgroup_removed(
    runtime: ProcessRuntime, root: Path
) -> None:
    runtime.start(key(), Launch(command=GREEDY, memory_bytes=64 * MIB))
    cgroup = Path((root / key().slug / "cgroup").read_text())

    observed = wait_until_ended(runtime, key())

    assert (observed.exit_code, observed.oom) == (137, True)
    assert "survived" not in runtime.log_tail(key(), 10, 4096)
    assert not cgroup.exists()


def test_a_worker_within_its_memory_bytes_runs_in_its_cgroup_from_its_first_instruction(
    runtime: ProcessRuntime, root: Path
) -> None:
    # cat is the command itself: the cgroup it reads is the one it was exec'd in, so it never ran outside it.
    command = ["sh", "-c", "cat /proc/self/cgroup; sleep 0.5; echo done"]
    runtime.start(key(), Launch(command=command, memory_bytes=64 * MIB))
    cgroup = Path((root / key().slug / "cgroup").read_text())
    assert limit_of(cgroup) == 64 * MIB

    observed = wait_until_ended(runtime, key())

    assert (observed.exit_code, observed.oom) == (0, False)
    log = runtime.log_tail(key(), 50, 16384)
    assert cgroup.name in log and log.endswith("done\n")
    assert not cgroup.exists()


def test_a_worker_without_memory_bytes_gets_no_cgroup(runtime: ProcessRuntime, root: Path) -> None:
    runtime.start(key(), Launch(command=["sh", "-c", "echo hi"]))

    assert wait_until_ended(runtime, key()) == Observed(running=False, exit_code=0)
    assert not (root / key().slug / "cgroup").exists()


def test_an_agent_that_restarted_sees_the_oom_kill_of_a_worker_it_did_not_start(
    root: Path, memory_cgroups: MemoryCgroups
) -> None:
    command = ["sh", "-c", f"sleep 0.5; exec {sys.executable} -c 'b = bytearray(256 << 20)'"]
    ProcessRuntime(root, memory_cgroups).start(key(), Launch(command=command, memory_bytes=64 * MIB))
    restarted = ProcessRuntime(root, memory_cgroups)

    assert restarted.observe(key()).running
    observed = wait_until_ended(restarted, key())
    assert (observed.exit_code, observed.oom) == (137, True)


def test_what_left_the_workers_process_group_ends_with_its_cgroup(runtime: ProcessRuntime, root: Path) -> None:
    runtime.start(key(), Launch(command=["sh", "-c", "setsid sleep 100 & echo $!"], memory_bytes=64 * MIB))
    cgroup = Path((root / key().slug / "cgroup").read_text())

    assert wait_until_ended(runtime, key()).exit_code == 0

    escaped = int(runtime.log_tail(key(), 1, 100))
    assert has_ended(escaped)
    assert not cgroup.exists()


def test_deleting_an_attempt_whose_shim_was_killed_removes_its_cgroup(runtime: ProcessRuntime, root: Path) -> None:
    runtime.start(key(), Launch(command=["sleep", "100"], memory_bytes=64 * MIB))
    directory = root / key().slug
    cgroup = Path((directory / "cgroup").read_text())
    os.kill(int((directory / "shim.pid").read_text()), signal.SIGKILL)
    os.killpg(int((directory / "pid").read_text()), signal.SIGKILL)
    assert wait_until_ended(runtime, key()).not_found
    assert cgroup.exists()

    runtime.delete(key())

    assert not cgroup.exists()


def test_a_cgroup_that_cannot_be_made_fails_the_start_and_nothing_runs(root: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    runtime = ProcessRuntime(root, MemoryCgroups(tmp_path / "file/astraeus", 1))

    with pytest.raises(RuntimeFailure) as refused:
        runtime.start(key(), Launch(command=["true"], memory_bytes=64 * MIB))

    cgroup = tmp_path / "file/astraeus" / key().slug
    assert refused.value.reason.text == f"Container create failed: memory cgroup {cgroup}: Not a directory"
    assert runtime.observe(key()).not_found


def test_where_memory_cannot_be_limited_the_worker_runs_unlimited_and_its_log_says_so(root: Path) -> None:
    runtime = ProcessRuntime(root, Unenforced("no cgroup memory controller is mounted on this machine"))
    runtime.start(key(), Launch(command=GREEDY, memory_bytes=64 * MIB))

    assert wait_until_ended(runtime, key()) == Observed(running=False, exit_code=0)
    assert runtime.log_tail(key(), 10, 4096) == (
        "astraeus: memory_bytes is not enforced on this machine: no cgroup memory controller is mounted on this "
        "machine\nsurvived\n"
    )


# --- Where the cgroups go, read from a fake /proc/self ----------------------------------------------------------


def proc_self(tmp_path: Path, mounts: list[str], own: str) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir(parents=True)
    (proc / "mountinfo").write_text("".join(f"{i} 1 0:{i} {line}\n" for i, line in enumerate(mounts, 30)))
    (proc / "cgroup").write_text(own)
    return proc


V1_OWN = "4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n"


def test_with_cgroup_v1_they_go_under_the_agents_own_memory_cgroup(tmp_path: Path) -> None:
    (tmp_path / "memory/process_api/abc").mkdir(parents=True)
    mounts = [
        f"/ {tmp_path}/cpu rw - cgroup cgroup rw,cpu,cpuacct",
        f"/ {tmp_path}/memory rw,relatime - cgroup cgroup rw,memory",
        f"/ {tmp_path}/unified rw - cgroup2 cgroup2 rw",  # hybrid: v2 without controllers beside
    ]

    found = find_memory_cgroups(proc_self(tmp_path, mounts, V1_OWN))

    assert found == MemoryCgroups(tmp_path / "memory/process_api/abc/astraeus", 1)


def test_in_a_container_that_sees_part_of_the_v1_hierarchy_they_go_under_its_root(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    mounts = [f"/docker/abc {tmp_path}/memory ro,relatime master:7 - cgroup cgroup rw,memory"]

    found = find_memory_cgroups(proc_self(tmp_path, mounts, "9:memory:/docker/abc\n"))

    assert found == MemoryCgroups(tmp_path / "memory/astraeus", 1)


def test_with_cgroup_v2_they_go_under_the_hierarchys_root(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    mounts = [f"/ {tmp_path} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"]

    found = find_memory_cgroups(proc_self(tmp_path, mounts, "0::/system.slice/astraeus.service\n"))

    assert found == MemoryCgroups(tmp_path / "astraeus", 2)


def test_without_a_memory_controller_memory_is_not_enforced_and_says_why(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu pids\n")
    v2 = [f"/ {tmp_path} rw - cgroup2 cgroup2 rw"]

    assert find_memory_cgroups(proc_self(tmp_path, v2, "0::/\n")) == Unenforced(
        f"the cgroup v2 hierarchy at {tmp_path} offers no memory controller"
    )
    assert find_memory_cgroups(proc_self(tmp_path / "none", [], "")) == Unenforced(
        "no cgroup memory controller is mounted on this machine"
    )


def test_a_v2_cgroup_gets_the_memory_controller_its_limit_and_no_swap(tmp_path: Path) -> None:
    # The files the kernel would make: cgroup.subtree_control in each cgroup, memory.swap.max once memory is on.
    (tmp_path / "cgroup.subtree_control").write_text("cpu io\n")
    (tmp_path / "astraeus").mkdir()
    (tmp_path / "astraeus/cgroup.subtree_control").write_text("\n")
    (tmp_path / "astraeus/team-a.mem.w-0.0").mkdir()
    (tmp_path / "astraeus/team-a.mem.w-0.0/memory.swap.max").write_text("max\n")

    cgroup = MemoryCgroups(tmp_path / "astraeus", 2).create("team-a.mem.w-0.0", 64 * MIB)

    assert cgroup == tmp_path / "astraeus/team-a.mem.w-0.0"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory\n"
    assert (tmp_path / "astraeus/cgroup.subtree_control").read_text() == "+memory\n"
    assert ((cgroup / "memory.max").read_text(), (cgroup / "memory.swap.max").read_text()) == ("67108864\n", "0\n")
