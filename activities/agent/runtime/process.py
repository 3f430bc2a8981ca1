"""The `process` runtime: each attempt is a local process under a shim, for machines without an engine.

An attempt lives in `root/<slug>/`: `launch.json` (what was asked), `shim.pid`, `pid` (the worker, leader of
its own process group), `log` (stdout and stderr), `cgroup` (the path of its memory cgroup, if it has one), `oom`
(there if the kernel killed it for memory) and `exit` (its code, written by the shim when it ends).
The files are the truth, so an agent that restarts finds its attempts again. A shim that cannot write one (a full disk)
keeps it and lives on until it can, saying so in its name: the attempt reads running, `Observed.held` says why.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from activities.agent.runtime import egress
from activities.agent.runtime.base import (
    EXEC_TIMED_OUT,
    ExecRefused,
    Executed,
    Held,
    Launch,
    Observed,
    OnProgress,
    RuntimeFailure,
    ignore_progress,
    port_environment,
    ran_too_long,
    readable,
)
from activities.agent.runtime.cgroups import MemoryCgroups, Unenforced, find_memory_cgroups
from activities.agent.runtime.forkserver import ForkServer, ForkServerError
from activities.agent.runtime.probes import exited, http_get, timed_out
from activities.agent.runtime.shim import end_cgroup, held, write_atomically
from workflows.domain.group_parts import Readiness
from workflows.domain.reasons import R
from workflows.domain.refs import TaskRef

# Programs workers may run with `python3 -m NAME` (the gang example's all-reduce): only this directory goes on their
# PYTHONPATH, never Astraeus's own packages or its dependencies, which would shadow a worker's.
_PROGRAMS = Path(__file__).resolve().with_name("programs")
_START_WAIT_SECONDS = 5.0
_KILL_WAIT_SECONDS = 5.0
_POLL_SECONDS = 0.01


class ProcessRuntime:
    """Runs attempts as local processes, each under a shim (`activities.agent.runtime.shim`, forked by the runtime's
    `ForkServer`) in its own session, and limits the memory of those that ask `memory_bytes` with a cgroup of their
    own (`memory`: where, or why it cannot)."""

    name = "process"
    pulls_images = False

    def __init__(self, root: Path, memory: MemoryCgroups | Unenforced | None = None) -> None:
        self.root = root
        self.memory = memory if memory is not None else find_memory_cgroups()
        self._forkserver = ForkServer()
        # Each shim this instance spawned, by attempt slug, while it lives: its pidfd (readable once it ended) and
        # its pid. The agent's threads look at them at once; one of them closes a pidfd, under the lock, once it ended.
        self._spawned: dict[str, _Spawned] = {}
        self._spawned_lock = threading.Lock()

    def prepare(self) -> None:
        """Start the shims' fork server before the first worker needs it (the agent does, when it starts)."""
        self._forkserver.start()

    def start(self, key: TaskRef, launch: Launch, on_progress: OnProgress = ignore_progress) -> None:
        """Start the attempt unless it already exists; returns once its worker started (or already ended).
        A process has no image to pull, and nothing can be mounted into it: mounts are refused."""
        _refuse_what_cannot_run(launch)
        directory = self._dir(key)
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RuntimeFailure(R.ContainerStartFailed(error=str(err))) from err
        with _locked(directory):
            if _exists(directory, "shim.pid") or _exists(directory, "exit"):
                return
            (directory / "launch.json").write_text(json.dumps(_recorded(launch)))
            if launch.egress is not None:  # in a network namespace of its own, behind its firewall
                write_atomically(directory / "netns", egress.namespace_of(key.slug))
                launch = dataclasses.replace(launch, command=[*egress.create(key.slug, launch.egress), *launch.command])
            cgroup = self._limit_memory(key, launch, directory)
            try:
                ready = self._spawn_shim(key, launch, directory, cgroup)
            except RuntimeFailure:
                if cgroup is not None:
                    end_cgroup(str(cgroup))
                raise
        self._wait_until_started(key, directory, ready)

    def ensure_image(self, launch: Launch, on_progress: OnProgress = ignore_progress) -> None:
        """A process has no image: nothing to pull. What it could never start is refused here already, so a gang
        member fails at set-up rather than after the barrier opened."""
        _refuse_what_cannot_run(launch)

    def observe(self, key: TaskRef) -> Observed:
        """Exited with a code, running while its shim lives (holding a record it cannot write, maybe: `held`), else
        not found (no directory, or a dead shim)."""
        directory = self._dir(key)
        shim_pid = self._spawned_pid(key)
        if shim_pid is not None:  # one this instance spawned: a poll of its pidfd and a read of its name, no file read
            return Observed(running=True, held=_held_by(shim_pid, directory))
        code = _read_int(directory / "exit")
        if code is None:
            shim_pid = _read_int(directory / "shim.pid")
            if shim_pid is not None and _runs_shim_of(shim_pid, directory):
                return Observed(running=True, held=_held_by(shim_pid, directory))
            # The shim writes the exit file just before it ends: look again after seeing it gone.
            code = _read_int(directory / "exit")
        if code is None:
            return Observed(running=False, not_found=True)
        _remove_namespace(directory)
        oom = _exists(directory, "oom")
        with suppress(FileNotFoundError):
            return Observed(running=False, exit_code=code, oom=oom, ended_at=(directory / "exit").stat().st_mtime)
        return Observed(running=False, exit_code=code, oom=oom)

    def ended_fd(self, key: TaskRef) -> int | None:
        """A pidfd of the attempt's shim, readable once it exited (its worker ended and the exit file is written);
        None for a shim this instance did not spawn (an agent that restarted polls those) or one already gone."""
        with self._spawned_lock:
            if not self._spawned_alive_locked(key):
                return None
            return os.dup(self._spawned[key.slug].pidfd)

    def probe(self, key: TaskRef, readiness: Readiness) -> tuple[bool, str]:
        """An HTTP GET to 127.0.0.1 (the worker shares the machine's network), or the command run as the worker
        runs: the same user, its working directory and the environment it was started with."""
        if readiness.http_get is not None:
            return http_get("127.0.0.1", readiness.http_get, readiness.timeout_seconds)
        assert readiness.command is not None
        directory = self._dir(key)
        env = _task_environment(directory)
        if env is None:
            return False, "the worker is not running"
        return _run_check(readiness.command, directory, env, readiness.timeout_seconds)

    def stop(self, key: TaskRef, grace_seconds: float) -> None:
        """SIGTERM the worker's process group, SIGKILL it after the grace period; returns once it ended (its shim
        may hold its exit still, which its watch reads once written)."""
        if _worker_ended(self.observe(key)):
            return
        directory = self._dir(key)
        # A start may still be in flight: its worker's pid comes within moments.
        _wait_for_file(directory, _START_WAIT_SECONDS, lambda: not self.observe(key).running)
        _signal_group(directory, signal.SIGTERM)
        if self._wait_until_ended(key, grace_seconds):
            return
        _signal_group(directory, signal.SIGKILL)
        if not self._wait_until_ended(key, _KILL_WAIT_SECONDS):
            raise TimeoutError(f"attempt {key.slug} still runs {_KILL_WAIT_SECONDS:g} s after SIGKILL")

    def exec(self, key: TaskRef, argv: list[str], stdin: bytes, timeout_seconds: float) -> Executed:
        """Run `argv` as the worker runs: the same user, its working directory, the environment it was started
        with, and its network namespace when it has one (an outbound policy's); killed, group and all, past its
        timeout."""
        directory = self._dir(key)
        env = _task_environment(directory)
        if env is None:
            raise ExecRefused("the worker is not running")
        with suppress(FileNotFoundError):
            argv = ["ip", "netns", "exec", (directory / "netns").read_text().strip(), *argv]
        return _run_session(argv, directory, env, stdin, timeout_seconds)

    def log_tail(self, key: TaskRef, lines: int, max_bytes: int) -> str:
        """The last `lines` lines of its output, then at most the last `max_bytes` bytes of those."""
        if lines <= 0 or max_bytes <= 0:
            return ""
        try:
            data = _read_end(self._dir(key) / "log", max_bytes)
        except FileNotFoundError:
            return ""
        return _last_lines(data, lines).decode("utf-8", errors="replace")

    def gpus_in_use(self) -> dict[str, list[int]]:
        """GPU indices held by attempts that still run, by attempt slug."""
        held: dict[str, list[int]] = {}
        for key in self.attempts():
            if self.observe(key).running:
                launch = json.loads((self._dir(key) / "launch.json").read_text())
                held[key.slug] = list(launch["gpu_indices"])
        return held

    def ports_in_use(self) -> dict[str, dict[str, int]]:
        """The machine's ports held by attempts that still run (from their launch.json), by attempt slug."""
        held: dict[str, dict[str, int]] = {}
        for key in self.attempts():
            if self.observe(key).running:
                launch = json.loads((self._dir(key) / "launch.json").read_text())
                ports = {p["name"]: int(p["host_port"]) for p in launch.get("ports", [])}
                if ports:
                    held[key.slug] = ports
        return held

    def delete(self, key: TaskRef) -> None:
        """Remove an ended attempt's directory, its log included. Deleting a missing attempt does nothing."""
        if self.observe(key).running:
            raise ValueError(f"attempt {key.slug} still runs: stop it before deleting it")
        with suppress(FileNotFoundError):
            end_cgroup((self._dir(key) / "cgroup").read_text())  # the shim removed it, unless it was killed first
        _remove_namespace(self._dir(key))
        with suppress(FileNotFoundError):
            shutil.rmtree(self._dir(key))

    def attempts(self) -> list[TaskRef]:
        """Every attempt this machine has a directory for, running or ended."""
        if not self.root.is_dir():
            return []
        keys = (_parse_slug(entry.name) for entry in self.root.iterdir() if entry.is_dir())
        return sorted((key for key in keys if key is not None), key=lambda key: key.slug)

    def running(self) -> list[TaskRef]:
        """The attempts whose shim still lives."""
        return [key for key in self.attempts() if self.observe(key).running]

    def _dir(self, key: TaskRef) -> Path:
        return self.root / key.slug

    def _limit_memory(self, key: TaskRef, launch: Launch, directory: Path) -> Path | None:
        """The attempt's memory cgroup, made with its limit, for a launch that asks `memory_bytes`. Where none can
        be made the worker runs unlimited, and its log says so first."""
        if launch.memory_bytes <= 0:
            return None
        if isinstance(self.memory, Unenforced):
            with open(directory / "log", "a") as log:
                log.write(f"astraeus: memory_bytes is not enforced on this machine: {self.memory.why}\n")
            return None
        try:
            cgroup = self.memory.create(key.slug, launch.memory_bytes)
        except OSError as err:
            error = f"memory cgroup {self.memory.parent / key.slug}: {err.strerror or err}"
            raise RuntimeFailure(R.ContainerCreateFailed(error=error)) from err
        write_atomically(directory / "cgroup", str(cgroup))
        return cgroup

    def _spawn_shim(self, key: TaskRef, launch: Launch, directory: Path, cgroup: Path | None) -> int:
        """Have the fork server fork the attempt's shim; returns the read end of the pipe the shim closes once its
        worker started (or could not start)."""
        env = _environment(key, launch)
        if any("\0" in text for text in (*launch.command, *env, *env.values())):
            raise RuntimeFailure(R.InvalidTask(error="embedded null byte"))
        ready, ready_for_shim = os.pipe()
        try:
            pid = self._forkserver.spawn(directory, launch.command, env, cgroup, ready_for_shim)
        except (ForkServerError, OSError) as err:
            os.close(ready)
            raise RuntimeFailure(R.ContainerStartFailed(error=str(err))) from err
        finally:
            os.close(ready_for_shim)
        with suppress(ProcessLookupError), self._spawned_lock:  # ended already: its files say how
            self._spawned[key.slug] = _Spawned(pidfd=os.pidfd_open(pid), pid=pid)
        return ready

    def _wait_until_started(self, key: TaskRef, directory: Path, ready: int) -> None:
        """Wait until the shim started the worker (or recorded that it could not); fail if the shim died. The shim
        closes its end of `ready` then, or when it dies: no polling."""
        try:
            closed = readable(ready, _START_WAIT_SECONDS)
        finally:
            os.close(ready)
        if _exists(directory, "pid") or _exists(directory, "exit"):
            return
        if closed and not self._spawned_alive(key) and not _exists(directory, "exit"):
            raise RuntimeFailure(R.ContainerStartFailed(error="the shim ended before starting the command"))
        # Still starting after the wait (a loaded machine): observe reports it running while its shim lives.

    def _spawned_alive(self, key: TaskRef) -> bool:
        """Whether the shim this instance spawned for `key` still lives (its pidfd not readable yet)."""
        with self._spawned_lock:
            return self._spawned_alive_locked(key)

    def _spawned_pid(self, key: TaskRef) -> int | None:
        """The pid of the shim this instance spawned for `key` while it lives (its pidfd not readable yet)."""
        with self._spawned_lock:
            return self._spawned[key.slug].pid if self._spawned_alive_locked(key) else None

    def _spawned_alive_locked(self, key: TaskRef) -> bool:
        spawned = self._spawned.get(key.slug)
        if spawned is None:
            return False
        if not readable(spawned.pidfd, 0):
            return True
        del self._spawned[key.slug]
        os.close(spawned.pidfd)
        return False

    def _wait_until_ended(self, key: TaskRef, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not _worker_ended(self.observe(key)):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_SECONDS)
        return True


@dataclasses.dataclass(frozen=True)
class _Spawned:
    """A shim this runtime spawned, while it lives."""

    pidfd: int  # readable once it ended
    pid: int  # valid while the pidfd is not readable


def _worker_ended(observed: Observed) -> bool:
    """Whether the attempt's worker ended: its exit is written, or its shim holds it (a full disk). Its process
    group is not signalled then: once reaped, its id may name another."""
    return not observed.running or (observed.held is not None and observed.held.record != "pid")


def _held_by(shim_pid: int, directory: Path) -> Held | None:
    """What the live shim `shim_pid` of `directory` holds, from its name (which needs no disk to say it)."""
    try:
        holding = held(Path(f"/proc/{shim_pid}/comm").read_text().strip())
    except OSError:  # ended meanwhile, or not Linux
        return None
    if holding is None:
        return None
    name, number = holding
    return Held(record=name, directory=str(directory), filesystem=_mount_point(directory), error=os.strerror(number))


def _mount_point(path: Path) -> str:
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return str(path)


def _environment(key: TaskRef, launch: Launch) -> dict[str, str]:
    """The agent's environment, the launch's, then ours: a worker never sees a GPU it was not given."""
    env = {**os.environ, **launch.env}
    env.update(
        CUDA_VISIBLE_DEVICES=",".join(str(index) for index in launch.gpu_indices),
        # Our indices are NVML's, in PCI bus order; CUDA numbers devices fastest first unless told otherwise.
        CUDA_DEVICE_ORDER="PCI_BUS_ID",
        ASTRAEUS_TASK=key.task_id,
        ASTRAEUS_RUN=key.job,
        ASTRAEUS_JOB=key.job,  # the same as ASTRAEUS_RUN, deprecated: kept for a release
        ASTRAEUS_NAMESPACE=key.namespace,
        ASTRAEUS_ATTEMPT=str(key.attempt),
    )
    env.update(port_environment(launch.ports, mapped=False))  # a process listens on the machine's port itself
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_PROGRAMS), env.get("PYTHONPATH", "")) if p)
    return env


def _task_environment(directory: Path) -> dict[str, str] | None:
    """The environment the worker was started with (its launch's, secrets included, never kept on disk), read
    from the running worker itself; None when it does not run."""
    pid = _read_int(directory / "pid")
    if pid is None or _exists(directory, "exit"):
        return None
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (os.fsdecode(entry).partition("=") for entry in raw.split(b"\0") if b"=" in entry)
    return {name: value for name, _, value in pairs}


def _remove_namespace(directory: Path) -> None:
    """An ended attempt's network namespace (its outbound policy's), once: the file naming it goes with it."""
    try:
        name = (directory / "netns").read_text().strip()
    except FileNotFoundError:
        return
    egress.remove(name)
    with suppress(FileNotFoundError):
        (directory / "netns").unlink()


PROCESS_SANDBOX = (
    "its agent runs workers as local processes (--runtime process); sandboxed workers need --runtime docker with "
    "gVisor's runsc registered with the engine"
)


def _refuse_what_cannot_run(launch: Launch) -> None:
    if not launch.command:
        raise RuntimeFailure(R.InvalidTask(error="the command is empty"))
    if launch.sandbox_runtime is not None:
        raise RuntimeFailure(R.AgentSandboxFailed(why=PROCESS_SANDBOX))
    if launch.mounts:
        targets = ", ".join(mount.target for mount in launch.mounts)
        error = f"the process runtime cannot mount drives or files ({targets}); run it on a docker machine"
        raise RuntimeFailure(R.InvalidTask(error=error))


def _run_session(argv: list[str], cwd: Path, env: dict[str, str], stdin: bytes, timeout_seconds: float) -> Executed:
    """Run a person's command in its own process group and collect its output; past its timeout it is killed, group
    and all, and what it wrote until then is kept. A program that cannot start gets the shell's codes (126, 127)."""
    try:
        command = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except FileNotFoundError:
        return Executed(127, b"", f"{argv[0]}: command not found\n".encode())
    except PermissionError:
        return Executed(126, b"", f"{argv[0]}: permission denied\n".encode())
    except (OSError, ValueError) as err:
        raise ExecRefused(f"{argv[0]}: {err}") from None
    try:
        stdout, stderr = command.communicate(stdin, timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):  # not reaped yet, so its id still names its group
            os.killpg(command.pid, signal.SIGKILL)
        stdout, stderr = command.communicate()
        return Executed(EXEC_TIMED_OUT, stdout, stderr + ran_too_long(timeout_seconds))
    return Executed(command.returncode, stdout, stderr)


def _run_check(command: list[str], cwd: Path, env: dict[str, str], timeout_seconds: float) -> tuple[bool, str]:
    """Run a readiness command in its own process group; one that outlives its timeout is killed, group and all."""
    try:
        check = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except FileNotFoundError:
        return False, f"{command[0]}: command not found"
    except PermissionError:
        return False, f"{command[0]}: permission denied"
    except (OSError, ValueError) as err:
        return False, f"{command[0]}: {err}"
    try:
        code = check.wait(timeout_seconds)
    except subprocess.TimeoutExpired:
        # Not reaped yet, so its id still names its group: killpg reaches no one else.
        with suppress(ProcessLookupError):
            os.killpg(check.pid, signal.SIGKILL)
        check.wait()
        return False, timed_out(timeout_seconds)
    code = 128 - code if code < 0 else code
    return code == 0, exited(code)


def _recorded(launch: Launch) -> dict[str, object]:
    """What is kept of a launch on disk: never its environment or credentials (secrets may be among them)."""
    kept = dataclasses.asdict(launch)
    kept.pop("env")
    kept.pop("registry_auth")
    return kept


def _runs_shim_of(pid: int, directory: Path) -> bool:
    """Whether process `pid` is alive and is the shim of `directory`: a process that works in it (a fork of the
    server, which has no command line of its own) or runs with it on its command line (a shim of a former
    version). Pids are reused, and zombies linger (and have neither)."""
    if not Path("/proc/self").exists():  # not Linux: trust the pid
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    try:
        if os.readlink(f"/proc/{pid}/cwd") == os.fspath(directory):
            return True
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return os.fsencode(directory) in cmdline.split(b"\0")


def _signal_group(directory: Path, signum: int) -> None:
    """Signal the worker's process group; it may end on its own at any moment."""
    pid = _read_int(directory / "pid")
    if pid is None or _exists(directory, "exit"):
        return
    with suppress(ProcessLookupError):
        os.killpg(pid, signum)


def _wait_for_file(directory: Path, seconds: float, give_up: Callable[[], bool]) -> bool:
    """Wait until the worker's pid or exit file exists; False on time out or when `give_up()` says so."""
    deadline = time.monotonic() + seconds
    while not (_exists(directory, "pid") or _exists(directory, "exit")):
        if give_up() or time.monotonic() >= deadline:
            return _exists(directory, "pid") or _exists(directory, "exit")
        time.sleep(_POLL_SECONDS)
    return True


def _read_end(path: Path, max_bytes: int) -> bytes:
    """The file's last `max_bytes` bytes, read from the end (a log may be huge), from a character's start."""
    with open(path, "rb") as file:
        start = max(0, file.seek(0, os.SEEK_END) - max_bytes)
        file.seek(start)
        data = file.read(max_bytes)
    # Cut mid-character, the first bytes would decode to U+FFFD, longer than they were: drop them.
    return data.lstrip(bytes(range(0x80, 0xC0))) if start else data


def _last_lines(data: bytes, lines: int) -> bytes:
    """The last `lines` lines of `data`; a final newline does not start another line."""
    start = len(data) - 1 if data.endswith(b"\n") else len(data)
    for _ in range(lines):
        start = data.rfind(b"\n", 0, start)
        if start < 0:
            return data
    return data[start + 1 :]


def _parse_slug(slug: str) -> TaskRef | None:
    """The key of an attempt directory `namespace.job.task.attempt`; None for anything else."""
    parts = slug.rsplit(".", 3)
    if len(parts) != 4 or not parts[3].isdigit():
        return None
    namespace, job, task, attempt = parts
    return TaskRef(namespace=namespace, job=job, task_id=task, attempt=int(attempt))


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold the attempt's lock, so that two starts at once (a retried activity) spawn one shim: a lock on its
    directory, not on a file of its own, since a new file costs more than the rest of a start on some disks."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _exists(directory: Path, name: str) -> bool:
    return (directory / name).exists()


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (FileNotFoundError, ValueError):
        return None
