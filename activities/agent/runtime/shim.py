"""A tiny supervisor of one attempt, like conmon: it outlives the agent and records how its worker ended.

The agent asks its fork server (`python -I -S shim.py --serve`, one per runtime,
`activities/agent/runtime/forkserver.py`) for each shim: the server forks one per request, in a session of its own,
which writes DIR/shim.pid (the server answers the agent once it did), starts the worker and writes DIR/pid, DIR/log and
DIR/exit, and closes the agent's pipe once the worker started or could not start. A forked shim costs about 3 ms of CPU
where a fresh interpreter cost 13 to 16 (one runs per worker). With a memory cgroup CG (made by the agent, its limit
set), the worker joins it before it runs the command; once the worker ended the shim writes DIR/oom if the kernel killed
anything in it for memory, ends what is left in it and removes it. A record it cannot write (a full disk) it keeps in
memory and writes again until it can, living on meanwhile, its name saying which record it holds and why (`held`). It
uses the standard library only, and the fewest modules of it (it forks and execs the worker itself)."""

from __future__ import annotations

# The C module under `signal`: the same calls, without the enum module that `signal` builds its constants with.
# Nor `subprocess` and `contextlib`: importing the three cost 6 of the shim's 19 ms of CPU.
import _signal as signal
import errno
import io
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_CGROUP_END_SECONDS = 5.0
_MAX_FD = os.sysconf("SC_OPEN_MAX")
_MAX_REQUEST = 1 << 20  # a request is its command and environment, as JSON
# A record that cannot be written is tried again after 1 s, then 2, 4, then every 5: a sleep, never a busy loop.
_HELD_FIRST_SECONDS = 1.0
_HELD_LONGEST_SECONDS = 5.0
# While it holds a record, the shim's name (/proc/<pid>/comm, at most 15 bytes, kept by the kernel: it needs no disk)
# is `held <record> <errno>`, e.g. "held exit 28": the agent reads it there (`held`).
_HELD = "held"


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` so that a reader sees the whole file or none of it. A write that fails leaves no file behind."""
    tmp = f"{os.fspath(path)}.{os.getpid()}.tmp"  # one writer per file, but a name of its own all the same
    try:
        with open(tmp, "w") as file:
            file.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:  # never made, or its directory is gone
            pass
        raise


def record(
    path: str,
    text: str,
    holding: Callable[[], None] = lambda: None,
    given_up: Callable[[], bool] = lambda: False,
    write: Callable[[str, str], None] = write_atomically,
    sleep: Callable[[float], None] = time.sleep,
    name: Callable[[str], None] | None = None,
) -> bool:
    """Write one of the attempt's records (`pid`, `oom`, `exit`), once. A write that fails (a full disk: ENOSPC,
    EDQUOT, or any OSError) loses nothing: the text is kept here and written again after 1 s, then 2, 4, then every
    5 s, and meanwhile the shim's name says which record it holds and why (`name`, /proc/self/comm by default), and
    `holding()` is called once. True once written; False if `given_up()` said so first (a pid no longer needed)."""
    rename = _rename if name is None else name
    delay, said = _HELD_FIRST_SECONDS, None
    while True:
        try:
            write(path, text)
        except OSError as err:
            if said is None:
                holding()
            if err.errno != said:
                said = err.errno or 0
                rename(f"{_HELD} {os.path.basename(path)} {said}")
        else:
            if said is not None:
                rename("astraeus-shim")
            return True
        if given_up():
            return False
        sleep(delay)
        delay = min(2 * delay, _HELD_LONGEST_SECONDS)


def held(name: str) -> tuple[str, int] | None:
    """What a shim named `name` (its /proc/<pid>/comm) holds: the record it could not write and the errno why;
    None for a shim that holds nothing."""
    parts = name.split()
    if len(parts) != 3 or parts[0] != _HELD or not parts[2].isdigit():
        return None
    return parts[1], int(parts[2])


def _rename(name: str) -> None:
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:  # no procfs: the shim holds its record all the same
        pass


def supervise(
    directory: str | os.PathLike[str], command: list[str], env: dict[str, str], ready_fd: int | None, cgroup: str | None
) -> int:
    """Run `command` in its own process group (and in `cgroup`, if given) with the environment `env`, wait for it,
    and record its exit code as a shell would. Closes `ready_fd` once the worker's pid (or its exit code, when it
    could not start) is written."""
    ready = _once(ready_fd)
    with open(os.path.join(directory, "log"), "ab") as log:
        try:
            procs = None if cgroup is None else os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
        except OSError as err:  # the worker must not run outside its limit
            log.write(f"shim: cannot put the worker in its memory cgroup {cgroup}: {err.strerror}\n".encode())
            code = 126
        else:
            code = _run(directory, command, log, procs, ready, env)
    # Kept until written, however long that takes (a full disk): a missing exit would make the agent count the
    # worker lost and run it again. The agent need not wait for the worker's start meanwhile.
    if cgroup is not None and end_cgroup(cgroup):
        record(os.path.join(directory, "oom"), "1\n", holding=ready)  # before exit: the exit file is the last word
    record(os.path.join(directory, "exit"), f"{code}\n", holding=ready)
    ready()
    return code


def _run(directory: str | os.PathLike[str], command: list[str], log: io.BufferedWriter, procs: int | None,
         ready: Callable[[], None], env: dict[str, str]) -> int:  # fmt: skip
    """Start the worker (joining the cgroup whose `cgroup.procs` is open as `procs` between fork and exec, so that
    the command never runs outside its limit), write its pid (until written, or until the worker ended), call
    `ready`, wait for the worker and return its exit code."""
    try:
        pid = _spawn(command, log.fileno(), procs, env)
    except _NotStarted as err:
        log.write(f"{err.args[0]}\n".encode())
        return err.code
    finally:
        _close(procs)
    record(os.path.join(directory, "pid"), f"{pid}\n", holding=ready, given_up=lambda: _ended(pid))
    ready()
    # As in a container, what the worker leaves in its group ends with it. Kill the group before
    # reaping the worker: until then its id cannot be reused, so killpg names no one else's group.
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _, status = os.waitpid(pid, 0)
    returncode = os.waitstatus_to_exitcode(status)
    return 128 - returncode if returncode < 0 else returncode


def _ended(pid: int) -> bool:
    """Whether the worker `pid` ended, without reaping it."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None


def _once(fd: int | None) -> Callable[[], None]:
    """A function that closes `fd` the first time it is called, and does nothing after (the number may be reused)."""
    fds = [fd]

    def close() -> None:
        if fds:
            _close(fds.pop())

    return close


class _NotStarted(Exception):
    """The worker could not start: the line for its log, and the exit code a shell would give."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


def _spawn(command: list[str], log_fd: int, procs: int | None, env: dict[str, str]) -> int:
    """Fork and exec `command` in a process group of its own, with stdin from /dev/null, stdout and stderr to
    `log_fd`, no other descriptor, and signals as a new process has them, as `subprocess` would. The child joins
    the cgroup last, just before exec: every page it touches from then on counts against the worker's limit, and
    a forked interpreter touches many. It says through a close-on-exec pipe why it could not exec; an empty pipe
    means it did. Returns its pid."""
    path = _which(command[0], env.get("PATH", os.defpath))
    if path is None:
        raise _NotStarted(f"{command[0]}: command not found", 127)
    reader, writer = os.pipe2(os.O_CLOEXEC)
    kept = sorted(fd for fd in (writer, procs) if fd is not None)
    pid = os.fork()
    if pid == 0:  # the child: only system calls until exec, and never back into the shim
        try:
            os.setpgid(0, 0)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            low = 3
            for fd in kept:
                os.closerange(low, fd)
                low = fd + 1
            os.closerange(low, _MAX_FD)
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_DFL)
            if procs is not None:
                try:
                    os.write(procs, b"0")  # 0: the writer itself
                except OSError:
                    os.write(writer, b"cgroup")
                    os._exit(126)
            os.execve(path, command, env)
        except OSError as err:
            os.write(writer, str(err.errno).encode())
        except BaseException:  # a command line exec cannot take (a NUL in an argument, say)
            os.write(writer, b"0")
        finally:
            os._exit(127)
    os.close(writer)
    said = b""
    while chunk := os.read(reader, 64):
        said += chunk
    os.close(reader)
    if not said:
        return pid
    os.waitpid(pid, 0)
    if said == b"cgroup":  # it must not run outside its limit
        raise _NotStarted("shim: cannot put the worker in its memory cgroup", 126)
    number = int(said)
    if number == errno.ENOENT:
        raise _NotStarted(f"{command[0]}: command not found", 127)
    if number == errno.EACCES:
        raise _NotStarted(f"{command[0]}: permission denied", 126)
    if number == 0:
        raise _NotStarted(f"{command[0]}: cannot be run", 126)
    raise _NotStarted(f"{command[0]}: {os.strerror(number)}", 126)  # not an executable file, say


def _which(name: str, search_path: str) -> str | None:
    """What exec would run for `name`, as a shell finds it: a path as given; else the first executable file of that
    name on `search_path` ($PATH), or failing one the first file (exec then says why it cannot run it); None when
    there is none."""
    if "/" in name:
        return name
    found = None
    for directory in search_path.split(os.pathsep):
        path = os.path.join(directory or ".", name)
        if os.path.isfile(path):
            if os.access(path, os.X_OK):
                return path
            found = found or path
    return found


def end_cgroup(cgroup: str) -> bool:
    """Whether the kernel killed anything in `cgroup` for memory; then end what is left in it and remove it, and
    its parent once empty. Never raises: a cgroup it cannot remove is left for the agent's `delete`."""
    oom = False
    for name in ("memory.events", "memory.oom_control"):  # v2, v1: both have a line `oom_kill N`
        try:
            with open(os.path.join(cgroup, name)) as counters:
                oom = any(line.split()[:1] == ["oom_kill"] and line.split()[1:2] != ["0"] for line in counters)
            break
        except OSError:
            continue
    deadline = time.monotonic() + _CGROUP_END_SECONDS
    while time.monotonic() < deadline:
        try:
            os.rmdir(cgroup)
        except OSError as err:
            if err.errno != errno.EBUSY:  # gone already (ENOENT), or not ours to remove
                break
            _kill_members(cgroup)  # what left the worker's process group still runs in its cgroup
            time.sleep(0.01)
        else:
            try:
                os.rmdir(os.path.dirname(cgroup))
            except OSError:  # the parent holds other attempts' cgroups
                pass
            break
    return oom


def _kill_members(cgroup: str) -> None:
    try:
        with open(os.path.join(cgroup, "cgroup.procs")) as procs:
            members = procs.read().split()
    except OSError:
        return
    for pid in members:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def serve(channel: int = 0) -> None:
    """The fork server: fork a shim for each request read from `channel` (a SOCK_SEQPACKET socket, its stdin) and
    answer its pid, until the agent closes its end. A request is a JSON object (`dir`, `command`, `env`, `cgroup`)
    with the write end of the agent's ready pipe attached. The kernel reaps the shims: none is the server's to wait
    for, and one that outlives it (its agent restarted) is reaped by whoever adopts it."""
    import json
    import socket

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    server = socket.socket(fileno=channel)
    while True:
        message, fds, _, _ = socket.recv_fds(server, _MAX_REQUEST, 1)
        if not message:
            return
        ready = fds[0] if fds else None
        recorded, recorded_by_shim = os.pipe()
        try:
            pid = os.fork()
        except OSError as err:
            for fd in (ready, recorded, recorded_by_shim):
                _close(fd)
            server.send(json.dumps({"error": f"fork: {err.strerror}"}).encode())
            continue
        if pid == 0:
            os.close(recorded)
            _become_shim(server.close, json.loads(message), ready, recorded_by_shim)
        _close(ready)
        os.close(recorded_by_shim)
        # Answered once the shim wrote its pid (or died): an agent that dies after this answer leaves shim.pid for
        # the next, and no file is written twice (on some disks a new file costs the agent a millisecond of CPU).
        os.read(recorded, 1)
        os.close(recorded)
        server.send(json.dumps({"pid": pid}).encode())


def _become_shim(leave_server: Callable[[], None], request: dict[str, Any], ready: int | None, recorded: int) -> None:
    """In the server's child: leave the server (its socket, its session, its ignored SIGCHLD), write DIR/shim.pid and
    close `recorded` (the server answers the agent then), supervise the worker and exit with its code. Never returns
    into the server's loop."""
    code = 1
    try:
        leave_server()  # its socket
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the shim waits for its worker: no reaping by the kernel
        # A no-op handler, not SIG_IGN: an ignored signal stays ignored across exec, a handled one is reset, so
        # the worker still ends on SIGTERM while the shim survives signals meant for the agent.
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda *_: None)
        directory = str(request["dir"])
        os.chdir(directory)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open("log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # the shim's own words go with its worker's
        for fd, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        write_atomically("shim.pid", f"{os.getpid()}\n")  # before the worker starts: an agent that dies now finds it
        os.close(recorded)
        code = supervise(directory, request["command"], request["env"], ready, request["cgroup"])
    except BaseException as err:  # its log says why, where people look
        os.write(2, f"shim: {type(err).__name__}: {err}\n".encode(errors="replace"))
    finally:
        os._exit(code)


def _close(fd: int | None) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:  # closed already
            pass


if __name__ == "__main__":
    if sys.argv[1:] != ["--serve"]:
        sys.exit("usage: shim.py --serve (with a SOCK_SEQPACKET socket as its stdin)")
    serve()
