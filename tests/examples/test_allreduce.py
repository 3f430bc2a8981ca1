"""activities/agent/runtime/programs/allreduce.py among real processes on 127.0.0.1: the all-reduce the gang example
runs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import yaml

from workers.devserver import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "activities" / "agent" / "runtime" / "programs" / "allreduce.py"
WAIT_SECONDS = 8.0


def environment(**variables: str | int | None) -> dict[str, str]:
    """The test's environment without any launcher variable, then `variables` (None: left unset)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update({name: str(value) for name, value in variables.items() if value is not None})
    return env


def rank_env(rank: int, world_size: int, port: int, **more: str | int | None) -> dict[str, str]:
    return environment(RANK=rank, WORLD_SIZE=world_size, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **more)


@contextmanager
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """Processes the test starts; each one still running at the end is killed by its PID."""
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for process in started:
            if process.poll() is None:
                with suppress(ProcessLookupError):
                    os.kill(process.pid, 9)
            process.wait()


def start(
    started: list[subprocess.Popen[str]],
    env: dict[str, str],
    *args: str,
    command: list[str] | None = None,
    cwd: Path = ROOT,
) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [*(command or [sys.executable, str(SCRIPT)]), *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    started.append(process)
    return process


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=WAIT_SECONDS)
    return process.returncode, out, err


def test_four_ranks_all_reduce_and_each_logs_its_start(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "starts"
    before = time.time()
    with processes() as started:
        for rank in (3, 1, 2, 0):  # the leader last: the others retry until it listens
            start(started, rank_env(rank, 4, port, ALLREDUCE_START_LOG=str(log)), "--timeout", "8")
            time.sleep(0.05)
        results = [finish(process) for process in started]

    for (code, out, err), rank in zip(results, (3, 1, 2, 0), strict=True):
        assert code == 0, err
        assert f"rank {rank}/4: all-reduce ok: [10.0, 20.0, 30.0, 40.0]" in out.splitlines()
        assert f"rank {rank}/4: started at " in out
    lines = [line.split() for line in log.read_text().splitlines()]
    assert sorted(int(rank) for rank, _ in lines) == [0, 1, 2, 3]
    assert all(before <= float(at) <= time.time() for _, at in lines)


def test_a_longer_vector(tmp_path: Path) -> None:
    port = free_port()
    with processes() as started:
        for rank in range(3):
            start(started, rank_env(rank, 3, port), "--size", "1000", "--timeout", "8")
        results = [finish(process) for process in started]

    expected = str([float((i + 1) * 6) for i in range(1000)])
    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"rank {rank}/3: all-reduce ok: {expected}" in out.splitlines()


def test_world_size_one_needs_no_peer_and_no_address(tmp_path: Path) -> None:
    log = tmp_path / "starts"
    with processes() as started:
        code, out, err = finish(start(started, environment(RANK=0, WORLD_SIZE=1, ALLREDUCE_START_LOG=str(log))))

    assert code == 0, err
    assert "rank 0/1: all-reduce ok: [1.0, 2.0, 3.0, 4.0]" in out.splitlines()
    assert log.read_text().split()[0] == "0"


def test_ranks_that_disagree_on_world_size_both_fail_and_say_why() -> None:
    port = free_port()
    with processes() as started:
        leader = start(started, rank_env(0, 2, port), "--timeout", "8")
        other = start(started, rank_env(1, 3, port), "--timeout", "8")
        (leader_code, _, leader_err), (other_code, _, other_err) = finish(leader), finish(other)

    assert leader_code == 1
    assert "rank 1 has WORLD_SIZE=3, rank 0 has WORLD_SIZE=2" in leader_err
    assert other_code == 1
    assert "rank 0 reports: rank 1 has WORLD_SIZE=3, rank 0 has WORLD_SIZE=2" in other_err


def test_a_missing_variable_is_a_clear_usage_error() -> None:
    with processes() as started:
        no_rank = start(started, environment(WORLD_SIZE=2, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port()))
        no_addr = start(started, environment(RANK=1, WORLD_SIZE=2, MASTER_PORT=free_port()))
        results = [finish(no_rank), finish(no_addr)]

    assert results[0][0] == 2
    assert "missing environment variable RANK" in results[0][2]
    assert results[1][0] == 2
    assert "missing environment variable MASTER_ADDR" in results[1][2]


def test_a_rank_outside_world_size_is_a_usage_error() -> None:
    with processes() as started:
        code, _, err = finish(start(started, rank_env(4, 4, free_port())))

    assert code == 2
    assert "RANK=4 is not in 0..3 (WORLD_SIZE=4)" in err


def test_a_missing_peer_times_out_with_a_clear_message() -> None:
    port = free_port()
    with processes() as started:
        leader = start(started, rank_env(0, 3, port), "--timeout", "1")
        follower = start(started, rank_env(1, 2, free_port()), "--timeout", "0.5")
        (leader_code, _, leader_err), (follower_code, _, follower_err) = finish(leader), finish(follower)

    assert leader_code == 1
    assert "timed out waiting for rank(s) [1, 2] to connect" in leader_err
    assert follower_code == 1
    assert "could not reach rank 0 at 127.0.0.1:" in follower_err


def test_the_gang_example_command_runs_from_any_directory(tmp_path: Path) -> None:
    """The process runtime starts a worker in its attempt directory with its programs on PYTHONPATH."""
    spec = yaml.safe_load((ROOT / "examples" / "gang-allreduce.yaml").read_text())
    (group,) = spec["groups"]
    assert spec["gang"] is True
    assert group["replicas"] == 4
    command = [sys.executable if word == "python3" else word for word in group["command"]]
    port = free_port()
    with processes() as started:
        for rank in range(2):
            env = rank_env(rank, 2, port, PYTHONPATH=str(SCRIPT.parent))
            start(started, env, "--timeout", "8", command=command, cwd=tmp_path)
        results = [finish(process) for process in started]

    for rank, (code, out, err) in enumerate(results):
        assert code == 0, err
        assert f"rank {rank}/2: all-reduce ok: [3.0, 6.0, 9.0, 12.0]" in out.splitlines()
