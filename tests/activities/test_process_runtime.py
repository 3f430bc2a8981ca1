"""The process runtime against real processes: start, observe, stop, logs, GPUs, an agent restart and readiness
checks (a command, an HTTP GET)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from activities.agent.runtime import process
from activities.agent.runtime.base import Launch, Observed, RuntimeFailure, readable
from activities.agent.runtime.forkserver import ForkServer
from activities.agent.runtime.process import ProcessRuntime
from tests.activities.runtimes import check, has_ended, kill_attempts, probe_until, wait_until_ended
from workers.agent_process import AgentOptions, make_runtime
from workers.devserver import free_port
from workflows.domain.refs import TaskRef


def key(task: str = "train-0", attempt: int = 1) -> TaskRef:
    return TaskRef(namespace="team-a", job="llm-7b", task_id=task, attempt=attempt)


def wait_for_text(path: Path, seconds: float = 5.0) -> str:
    """The file's text once it has some: a started worker needs a moment to write."""
    deadline = time.monotonic() + seconds
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} stays empty"
        time.sleep(0.01)
    return path.read_text()


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """The runtime's root; every worker and shim started under it is killed by pid afterwards."""
    yield tmp_path / "attempts"
    kill_attempts(tmp_path / "attempts")


@pytest.fixture
def runtime(root: Path) -> ProcessRuntime:
    return ProcessRuntime(root)


def test_a_worker_that_succeeds_exits_0(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=python("print('hello')")))

    assert wait_until_ended(runtime, key()) == Observed(running=False, exit_code=0)
    assert runtime.log_tail(key(), 50, 16384) == "hello\n"


def test_a_worker_that_fails_reports_its_code_and_its_stderr(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=["sh", "-c", "echo boom >&2; exit 3"]))

    assert wait_until_ended(runtime, key()).exit_code == 3
    assert "boom" in runtime.log_tail(key(), 50, 16384)


def test_a_worker_starts_with_stdin_stdout_and_stderr_only_and_the_signals_python_ignores_restored(
    runtime: ProcessRuntime,
) -> None:
    """No descriptor of the shim's (the agent's pipe among them), and neither SIGPIPE nor SIGXFSZ ignored: Python
    ignores both, and a worker must not inherit that. (What the agent itself inherited ignored, it passes on, as
    any launcher does: the test reads only the signals the shim's Python touches.)"""
    script = "ls /proc/$$/fd; grep SigIgn /proc/self/status"  # no pipe: the shell would hold its ends open
    runtime.start(key(), Launch(command=["sh", "-c", script]))

    assert wait_until_ended(runtime, key()).exit_code == 0
    *fds, ignored = runtime.log_tail(key(), 50, 16384).splitlines()
    assert fds == ["0", "1", "2"]
    mask = int(ignored.removeprefix("SigIgn:").strip(), 16)
    touched = [signal.SIGHUP, signal.SIGINT, signal.SIGPIPE, signal.SIGTERM, signal.SIGXFSZ]
    assert [s for s in touched if mask & (1 << (s - 1))] == []


def test_a_command_that_does_not_exist_exits_127_and_says_so(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=["no-such-program-here", "--flag"]))

    assert wait_until_ended(runtime, key()).exit_code == 127
    assert runtime.log_tail(key(), 50, 16384) == "no-such-program-here: command not found\n"


def test_a_file_without_execute_permission_exits_126(runtime: ProcessRuntime, tmp_path: Path) -> None:
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho never\n")

    runtime.start(key(), Launch(command=[str(script)]))

    assert wait_until_ended(runtime, key()).exit_code == 126
    assert "permission denied" in runtime.log_tail(key(), 50, 16384)


def test_a_file_that_cannot_be_executed_exits_126(runtime: ProcessRuntime, tmp_path: Path) -> None:
    binary = tmp_path / "not-a-program"
    binary.write_bytes(b"\x7fELF garbage")
    binary.chmod(0o755)

    runtime.start(key(), Launch(command=[str(binary)]))

    assert wait_until_ended(runtime, key()).exit_code == 126
    assert runtime.log_tail(key(), 50, 16384) == f"{binary}: Exec format error\n"


def test_an_empty_command_is_an_invalid_task(runtime: ProcessRuntime) -> None:
    with pytest.raises(RuntimeFailure) as failure:
        runtime.start(key(), Launch(command=[]))

    assert failure.value.reason.code == "InvalidTask"
    assert runtime.observe(key()).not_found


def test_stop_ends_a_worker_with_sigterm_within_the_grace(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=["sleep", "60"]))
    assert runtime.observe(key()).running

    started = time.monotonic()
    runtime.stop(key(), grace_seconds=5)

    assert time.monotonic() - started < 2
    assert runtime.observe(key()) == Observed(running=False, exit_code=143)


def test_stop_kills_a_worker_that_ignores_sigterm_after_the_grace(runtime: ProcessRuntime, root: Path) -> None:
    runtime.start(key(), Launch(command=["sh", "-c", 'trap "" TERM; touch trapped; sleep 60']))
    wait_for_text(root / key().slug / "pid")
    deadline = time.monotonic() + 5  # start returns once the worker runs, maybe before sh set its trap
    while not (root / key().slug / "trapped").exists():
        assert time.monotonic() < deadline, "sh never set its trap"
        time.sleep(0.01)

    started = time.monotonic()
    runtime.stop(key(), grace_seconds=0.5)

    assert 0.5 <= time.monotonic() - started < 3
    assert runtime.observe(key()) == Observed(running=False, exit_code=137)


def test_stop_of_an_ended_or_unknown_attempt_does_nothing(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=["true"]))
    wait_until_ended(runtime, key())

    runtime.stop(key(), grace_seconds=1)
    runtime.stop(key("never-started"), grace_seconds=1)

    assert runtime.observe(key()).exit_code == 0


def test_stop_ends_what_the_worker_started_in_its_group(runtime: ProcessRuntime, tmp_path: Path) -> None:
    grandchild = tmp_path / "grandchild.pid"
    runtime.start(
        key(),
        Launch(command=["sh", "-c", f"sleep 60 & echo $! > {grandchild}.tmp; mv {grandchild}.tmp {grandchild}; wait"]),
    )
    pid = int(wait_for_text(grandchild))

    runtime.stop(key(), grace_seconds=2)

    deadline = time.monotonic() + 2  # a signalled process dies when it is next scheduled
    while not has_ended(pid):
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        time.sleep(0.01)


def test_starting_twice_starts_one_process(runtime: ProcessRuntime, tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    launch = Launch(command=["sh", "-c", f"echo started >> {starts}; sleep 60"])

    runtime.start(key(), launch)
    runtime.start(key(), launch)

    assert runtime.observe(key()).running
    assert wait_for_text(starts) == "started\n"
    runtime.stop(key(), grace_seconds=1)
    runtime.start(key(), launch)  # an ended attempt is not started again
    time.sleep(0.2)
    assert starts.read_text() == "started\n"


def test_two_starts_at_once_start_one_process(runtime: ProcessRuntime, tmp_path: Path) -> None:
    starts = tmp_path / "starts"
    launch = Launch(command=["sh", "-c", f"echo started >> {starts}; sleep 60"])

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda _: runtime.start(key(), launch), range(4)))

    assert wait_for_text(starts) == "started\n"
    time.sleep(0.2)  # time for a second worker to show itself
    assert starts.read_text() == "started\n"


def test_a_start_makes_each_file_of_its_attempt_once_and_locks_its_directory(
    runtime: ProcessRuntime, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new file can cost a start more CPU than the rest of it (ext4 without a journal, bench/README.md): the
    attempt's files are launch.json (the agent's), log, shim.pid and pid (the shim's), each made once. The lock is
    the directory's, and shim.pid is there, written by the shim, when the fork server answers."""
    written: list[str] = []
    write = process.write_atomically
    monkeypatch.setattr(process, "write_atomically", lambda path, text: (written.append(str(path)), write(path, text)))
    at_answer: list[str] = []
    spawn = ForkServer.spawn

    def spawned(server: ForkServer, directory: Path, *rest: object) -> int:
        pid = spawn(server, directory, *rest)  # type: ignore[arg-type]
        at_answer.append((directory / "shim.pid").read_text())
        return pid

    monkeypatch.setattr(ForkServer, "spawn", spawned)
    runtime.start(key(), Launch(command=["sleep", "60"]))

    shim = int((root / key().slug / "shim.pid").read_text())
    assert at_answer == [f"{shim}\n"]
    assert written == []
    assert sorted(os.listdir(root / key().slug)) == ["launch.json", "log", "pid", "shim.pid"]
    assert runtime.observe(key()).running


def test_a_restarted_agent_finds_its_running_attempt_and_later_its_exit_code(root: Path, tmp_path: Path) -> None:
    release = tmp_path / "release"
    command = ["sh", "-c", f"while [ ! -e {release} ]; do sleep 0.02; done; exit 7"]
    ProcessRuntime(root).start(key(), Launch(command=command, gpu_indices=[1]))

    restarted = ProcessRuntime(root)
    assert restarted.attempts() == [key()]
    assert restarted.observe(key()).running
    assert restarted.gpus_in_use() == {key().slug: [1]}

    release.touch()
    assert wait_until_ended(restarted, key()) == Observed(running=False, exit_code=7)
    assert restarted.gpus_in_use() == {}


def test_running_lists_the_attempts_that_run_and_not_those_that_ended(runtime: ProcessRuntime) -> None:
    runtime.start(key("busy"), Launch(command=["sleep", "30"]))
    runtime.start(key("done"), Launch(command=["true"]))
    assert wait_until_ended(runtime, key("done")) == Observed(running=False, exit_code=0)
    assert runtime.running() == [key("busy")]
    runtime.stop(key("busy"), grace_seconds=0)
    assert runtime.running() == []
    assert runtime.attempts() == [key("busy"), key("done")]


def test_a_worker_sees_the_gpus_it_was_given_and_its_names(runtime: ProcessRuntime) -> None:
    show = "env | grep -E '^(CUDA_VISIBLE_DEVICES|ASTRAEUS_|GREETING)' | sort"
    runtime.start(key(), Launch(command=["sh", "-c", show], env={"GREETING": "hi"}, gpu_indices=[2, 5]))
    runtime.start(key("eval-0"), Launch(command=["sh", "-c", "echo [$CUDA_VISIBLE_DEVICES]"]))

    wait_until_ended(runtime, key())
    wait_until_ended(runtime, key("eval-0"))

    assert runtime.log_tail(key(), 50, 16384).splitlines() == [
        "ASTRAEUS_ATTEMPT=1",
        "ASTRAEUS_JOB=llm-7b",
        "ASTRAEUS_NAMESPACE=team-a",
        "ASTRAEUS_RUN=llm-7b",
        "ASTRAEUS_TASK=train-0",
        "CUDA_VISIBLE_DEVICES=2,5",
        "GREETING=hi",
    ]
    assert runtime.log_tail(key("eval-0"), 50, 16384) == "[]\n"


def test_log_tail_keeps_the_last_lines_and_at_most_max_bytes(runtime: ProcessRuntime) -> None:
    short = "for i in range(1000): print(f'line {i}')"
    long = "for i in range(1000): print(f'line {i} ' + 'x' * 1000)"
    runtime.start(key("short"), Launch(command=python(short)))
    runtime.start(key("long"), Launch(command=python(long)))
    wait_until_ended(runtime, key("short"))
    wait_until_ended(runtime, key("long"))

    assert runtime.log_tail(key("short"), 50, 16384).splitlines() == [f"line {i}" for i in range(950, 1000)]
    tail = runtime.log_tail(key("long"), 50, 16384)
    assert len(tail.encode()) == 16384
    assert tail.endswith(f"line 999 {'x' * 1000}\n")
    assert runtime.log_tail(key("nothing"), 50, 16384) == ""


def test_log_tail_does_not_start_mid_character(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=python("print('\u00e9' * 100)")))
    wait_until_ended(runtime, key())

    assert runtime.log_tail(key(), 50, 8) == "\u00e9" * 3 + "\n"


def test_an_unknown_attempt_is_not_found(runtime: ProcessRuntime) -> None:
    assert runtime.observe(key("unknown")) == Observed(running=False, not_found=True)
    assert runtime.attempts() == []
    assert runtime.gpus_in_use() == {}


def test_an_attempt_whose_shim_died_is_not_found(runtime: ProcessRuntime, root: Path) -> None:
    runtime.start(key(), Launch(command=["sleep", "60"]))
    os.kill(int((root / key().slug / "shim.pid").read_text()), signal.SIGKILL)  # first, or it writes an exit
    os.killpg(int((root / key().slug / "pid").read_text()), signal.SIGKILL)
    time.sleep(0.1)

    assert runtime.observe(key()) == Observed(running=False, not_found=True)


def test_delete_removes_an_ended_attempt_but_not_a_running_one(runtime: ProcessRuntime) -> None:
    runtime.start(key("done"), Launch(command=["true"]))
    runtime.start(key("busy"), Launch(command=["sleep", "60"]))
    wait_until_ended(runtime, key("done"))

    runtime.delete(key("done"))
    with pytest.raises(ValueError, match="still runs"):
        runtime.delete(key("busy"))

    assert runtime.attempts() == [key("busy")]
    assert runtime.observe(key("done")).not_found


# ---- readiness checks ---------------------------------------------------------------------------------------------


def test_a_command_check_runs_in_the_workers_environment_and_directory(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=["sleep", "30"], env={"TOKEN": "s3cret"}, gpu_indices=[1]))
    wait_for_text(runtime.root / key().slug / "pid")
    worker_like = 'test "$TOKEN" = s3cret && test "$CUDA_VISIBLE_DEVICES" = 1 && test -f launch.json'

    # A probe is tried each period: on a loaded machine the first may come before the worker's program is in place.
    assert probe_until(runtime, key(), check(["sh", "-c", worker_like])) == "exited with code 0"
    assert runtime.probe(key(), check(["sh", "-c", "exit 3"])) == (False, "exited with code 3")
    assert runtime.probe(key(), check(["no-such-check"])) == (False, "no-such-check: command not found")


def test_a_command_check_past_its_timeout_is_killed_and_fails(runtime: ProcessRuntime, tmp_path: Path) -> None:
    runtime.start(key(), Launch(command=["sleep", "30"]))
    wait_for_text(runtime.root / key().slug / "pid")
    marker = tmp_path / "check-ran-on"

    began = time.monotonic()
    result = runtime.probe(key(), check(["sh", "-c", f"sleep 0.6; touch {marker}"], timeout=0.3))

    assert result == (False, "timed out after 0.3s")
    assert time.monotonic() - began < 0.6
    time.sleep(0.6)
    assert not marker.exists()  # its whole group was killed


def test_a_command_check_of_a_worker_that_does_not_run_fails(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=["true"]))
    wait_until_ended(runtime, key())

    assert runtime.probe(key(), check(["true"])) == (False, "the worker is not running")
    assert runtime.probe(key("unknown-0"), check(["true"])) == (False, "the worker is not running")


def test_an_http_check_gets_the_workers_port_on_loopback(runtime: ProcessRuntime, tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "sub").mkdir(parents=True)
    (site / "index.html").write_text("ok\n")
    port = free_port()
    server = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(site)]
    runtime.start(key(), Launch(command=server))

    assert probe_until(runtime, key(), check(port=port, path="/")) == "HTTP 200"
    assert runtime.probe(key(), check(port=port, path="/sub")) == (True, "HTTP 301")  # a redirect passes
    assert runtime.probe(key(), check(port=port, path="/missing")) == (False, "HTTP 404")


def test_an_http_check_fails_on_a_closed_port_and_on_a_silent_one(runtime: ProcessRuntime) -> None:
    runtime.start(key(), Launch(command=["sleep", "30"]))

    assert runtime.probe(key(), check(port=free_port())) == (False, "connection refused")
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        began = time.monotonic()
        assert runtime.probe(key(), check(port=silent.getsockname()[1], timeout=0.3)) == (
            False,
            "timed out after 0.3s",
        )
        assert time.monotonic() - began < 2


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_shims_are_forked_by_one_server_and_outlive_it(runtime: ProcessRuntime, root: Path) -> None:
    """Each shim is a fork of the runtime's fork server (no interpreter started per worker), in a session of its
    own; the server ends with its runtime, the shims and their workers live on, and a runtime started again (an
    agent restarted) finds them running."""
    for task in ("a-0", "b-0"):
        runtime.start(key(task), Launch(command=["sleep", "60"]))
    shims = [int((root / key(task).slug / "shim.pid").read_text()) for task in ("a-0", "b-0")]
    server = parent_of(shims[0])
    assert parent_of(shims[1]) == server != os.getpid()
    assert parent_of(server) == os.getpid()
    assert [os.getsid(pid) for pid in shims] == shims

    runtime._forkserver.close()  # as when the agent exits
    assert not Path(f"/proc/{server}").exists()
    restarted = ProcessRuntime(root)
    assert [restarted.observe(key(task)).running for task in ("a-0", "b-0")] == [True, True]
    restarted.stop(key("a-0"), grace_seconds=5)
    assert restarted.observe(key("a-0")) == Observed(running=False, exit_code=143)


def fork_servers() -> list[int]:
    """This process's children that are shims' fork servers."""
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and parent_of(int(entry.name)) == os.getpid()
        and b"--serve" in (entry / "cmdline").read_bytes().split(b"\0")
    ]


def test_an_agent_s_runtime_starts_its_fork_server_before_its_first_worker(tmp_path: Path) -> None:
    """The agent's runtime (`make_runtime`) starts the fork server when it is made: a machine's first worker does
    not wait for an interpreter to start, nor does a burst's first start on each machine pay for one."""
    before = set(fork_servers())
    runtime = make_runtime(AgentOptions(name="m-0", data_dir=tmp_path))
    assert isinstance(runtime, ProcessRuntime)
    try:
        [server] = set(fork_servers()) - before
        runtime.start(key(), Launch(command=["sleep", "60"]))
        assert parent_of(int((tmp_path / "tasks" / key().slug / "shim.pid").read_text())) == server
    finally:
        runtime._forkserver.close()
        kill_attempts(tmp_path / "tasks")


def test_a_fork_server_that_died_is_started_again(runtime: ProcessRuntime, root: Path) -> None:
    runtime.start(key("a-0"), Launch(command=["sleep", "60"]))
    server = parent_of(int((root / key("a-0").slug / "shim.pid").read_text()))
    os.kill(server, signal.SIGKILL)
    os.waitpid(server, 0)

    runtime.start(key("b-0"), Launch(command=["true"]))

    assert wait_until_ended(runtime, key("b-0")).exit_code == 0
    assert parent_of(int((root / key("a-0").slug / "shim.pid").read_text())) != server  # adopted by another
    assert runtime.observe(key("a-0")).running


def test_a_nul_byte_in_the_command_or_its_environment_is_an_invalid_task(runtime: ProcessRuntime) -> None:
    for launch in (Launch(command=["echo", "a\0b"]), Launch(command=["true"], env={"X": "a\0b"})):
        with pytest.raises(RuntimeFailure) as failure:
            runtime.start(key(), launch)
        assert (failure.value.reason.code, failure.value.reason.text) == (
            "InvalidTask",
            "Invalid task: embedded null byte",
        )
    assert runtime.observe(key()).not_found


def test_the_shim_runs_only_as_the_fork_server_and_says_so(tmp_path: Path) -> None:
    from activities.agent.runtime import shim

    ran = subprocess.run([sys.executable, "-I", "-S", shim.__file__], capture_output=True, text=True, cwd=tmp_path)
    assert (ran.returncode, ran.stderr) == (1, "usage: shim.py --serve (with a SOCK_SEQPACKET socket as its stdin)\n")
    assert list(tmp_path.iterdir()) == []


def test_a_runtime_holding_descriptors_past_1024_starts_and_watches_workers(runtime: ProcessRuntime) -> None:
    """An agent with hundreds of workers holds a pidfd for each (and more): select() cannot wait on those."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        runtime.start(key(), Launch(command=["sleep", "0.2"]))
        assert runtime.observe(key()).running
        assert wait_until_ended(runtime, key()).exit_code == 0
    finally:
        for fd in held:
            os.close(fd)


def test_threads_that_look_at_once_at_a_shim_that_just_ended_all_see_it_ended(runtime: ProcessRuntime) -> None:
    """The agent's threads observe, stop and watch its workers at once: each sees the end, none fails, and a watch
    gets a pidfd of its own or none (never one another thread closed)."""
    with ThreadPoolExecutor(16) as pool:
        for attempt in range(40):
            runtime.start(key(attempt=attempt), Launch(command=["true"]))
            held = runtime.ended_fd(key(attempt=attempt))
            if held is None:
                continue  # it ended before we looked
            while not readable(held, 0):  # it ended: now every thread looks at once
                time.sleep(0.001)
            os.close(held)
            looks = [
                pool.submit(runtime.observe if n % 2 else runtime.ended_fd, key(attempt=attempt)) for n in range(16)
            ]
            for look in looks:
                seen = look.result()
                assert seen is None or seen == Observed(running=False, exit_code=0, ended_at=seen.ended_at)
