"""A tiny supervisor of one attempt, like conmon: it outlives the agent and records how its worker ended.

Run as `python -I -S shim.py --dir DIR [--ready-fd FD] [--cgroup CG] -- CMD ARGS...`; it writes DIR/pid, DIR/log
and DIR/exit, and closes FD (a pipe the agent waits on) once the worker started or could not start. With a memory
cgroup CG (made by the agent, its limit set), the worker joins it before it runs the command; once the worker ended
the shim writes DIR/oom if the kernel killed anything in it for memory, ends what is left in it and removes it. It
uses the standard library only, and the fewest modules of it, so that it starts in a few milliseconds: one runs per
worker.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import signal
import subprocess
import sys
import time

USAGE = "usage: shim.py --dir DIR [--ready-fd FD] [--cgroup CG] -- CMD [ARGS...]"
_OPTIONS = ("--dir", "--ready-fd", "--cgroup")
_CGROUP_END_SECONDS = 5.0


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` so that a reader sees the whole file or none of it."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as file:
        file.write(text)
    os.replace(tmp, path)


def supervise(
    directory: str | os.PathLike[str], command: list[str], ready_fd: int | None = None, cgroup: str | None = None
) -> int:
    """Run `command` in its own process group (and in `cgroup`, if given), wait for it, and record its exit code as
    a shell would. Closes `ready_fd` once the worker's pid (or its exit code, when it could not start) is written."""
    with open(os.path.join(directory, "log"), "ab") as log:
        try:
            procs = None if cgroup is None else os.open(os.path.join(cgroup, "cgroup.procs"), os.O_WRONLY)
        except OSError as err:  # the worker must not run outside its limit
            log.write(f"shim.py: cannot put the worker in its memory cgroup {cgroup}: {err.strerror}\n".encode())
            code = 126
        else:
            code = _run(directory, command, log, procs, ready_fd)
    if cgroup is not None and end_cgroup(cgroup):
        write_atomically(os.path.join(directory, "oom"), "1\n")  # before exit: the exit file is the last word
    write_atomically(os.path.join(directory, "exit"), f"{code}\n")
    _close(ready_fd)
    return code


def _run(directory: str | os.PathLike[str], command: list[str], log: io.BufferedWriter, procs: int | None,
         ready_fd: int | None) -> int:  # fmt: skip
    """Start the worker (joining the cgroup whose `cgroup.procs` is open as `procs` between fork and exec, so that
    the command never runs outside its limit), write its pid, wait for it and return its exit code."""
    try:
        child = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=None if procs is None else lambda: os.write(procs, b"0"),  # 0: the writer itself
        )
    except subprocess.SubprocessError:  # the join failed: it must not run outside its limit
        log.write(b"shim.py: cannot put the worker in its memory cgroup\n")
        return 126
    except FileNotFoundError:
        log.write(f"{command[0]}: command not found\n".encode())
        return 127
    except PermissionError:
        log.write(f"{command[0]}: permission denied\n".encode())
        return 126
    except OSError as err:  # not an executable file, say
        log.write(f"{command[0]}: {err.strerror}\n".encode())
        return 126
    finally:
        _close(procs)
    write_atomically(os.path.join(directory, "pid"), f"{child.pid}\n")
    _close(ready_fd)
    # As in a container, what the worker leaves in its group ends with it. Kill the group before
    # reaping the worker: until then its id cannot be reused, so killpg names no one else's group.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    returncode = child.wait()
    return 128 - returncode if returncode < 0 else returncode


def end_cgroup(cgroup: str) -> bool:
    """Whether the kernel killed anything in `cgroup` for memory; then end what is left in it and remove it, and
    its parent once empty. Never raises: a cgroup it cannot remove is left for the agent's `delete`."""
    oom = False
    for name in ("memory.events", "memory.oom_control"):  # v2, v1: both have a line `oom_kill N`
        with contextlib.suppress(OSError), open(os.path.join(cgroup, name)) as counters:
            oom = any(line.split()[:1] == ["oom_kill"] and line.split()[1:2] != ["0"] for line in counters)
            break
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
            with contextlib.suppress(OSError):  # the parent holds other attempts' cgroups
                os.rmdir(os.path.dirname(cgroup))
            break
    return oom


def _kill_members(cgroup: str) -> None:
    with contextlib.suppress(OSError), open(os.path.join(cgroup, "cgroup.procs")) as procs:
        for pid in procs.read().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def parse(argv: list[str]) -> tuple[str, int | None, str | None, list[str]]:
    """(DIR, FD or None, CG or None, command) from `--dir DIR [--ready-fd FD] [--cgroup CG] -- CMD ARGS...`;
    ValueError says what is wrong."""
    options: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0] != "--":
        flag = rest.pop(0)
        if flag not in _OPTIONS:
            raise ValueError(f"unexpected argument {flag!r}")
        if not rest:
            raise ValueError(f"{flag} needs a value")
        options[flag] = rest.pop(0)
    if "--dir" not in options:
        raise ValueError("--dir is required")
    if len(rest) < 2:
        raise ValueError("no command after --")
    fd = options.get("--ready-fd")
    if fd is not None and not fd.isdigit():
        raise ValueError(f"--ready-fd must be a file descriptor, not {fd!r}")
    return options["--dir"], None if fd is None else int(fd), options.get("--cgroup"), rest[1:]


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):  # closed already
            os.close(fd)


def main() -> None:
    try:
        directory, ready_fd, cgroup, command = parse(sys.argv[1:])
    except ValueError as err:
        sys.exit(f"shim.py: {err}\n{USAGE}")
    # A no-op handler, not SIG_IGN: an ignored signal stays ignored across exec, a handled one is reset, so
    # the worker still ends on SIGTERM while the shim survives signals meant for the agent.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    supervise(directory, command, ready_fd, cgroup)


if __name__ == "__main__":
    main()
