"""A tiny supervisor of one attempt, like conmon: it outlives the agent and records how its worker ended.

Run as `python -I -S shim.py --dir DIR [--ready-fd FD] -- CMD ARGS...`; it writes DIR/pid, DIR/log and DIR/exit,
and closes FD (a pipe the agent waits on) once the worker started or could not start. It uses the standard
library only, and the fewest modules of it, so that it starts in a few milliseconds: one runs per worker.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

USAGE = "usage: shim.py --dir DIR [--ready-fd FD] -- CMD [ARGS...]"


def write_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` so that a reader sees the whole file or none of it."""
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as file:
        file.write(text)
    os.replace(tmp, path)


def supervise(directory: str | os.PathLike[str], command: list[str], ready_fd: int | None = None) -> int:
    """Run `command` in its own process group, wait for it, and record its exit code as a shell would. Closes
    `ready_fd` once the worker's pid (or its exit code, when it could not start) is written."""
    with open(os.path.join(directory, "log"), "ab") as log:
        try:
            child = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, process_group=0
            )
        except FileNotFoundError:
            log.write(f"{command[0]}: command not found\n".encode())
            code = 127
        except PermissionError:
            log.write(f"{command[0]}: permission denied\n".encode())
            code = 126
        except OSError as err:  # not an executable file, say
            log.write(f"{command[0]}: {err.strerror}\n".encode())
            code = 126
        else:
            write_atomically(os.path.join(directory, "pid"), f"{child.pid}\n")
            _close(ready_fd)
            # As in a container, what the worker leaves in its group ends with it. Kill the group before
            # reaping the worker: until then its id cannot be reused, so killpg names no one else's group.
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            returncode = child.wait()
            code = 128 - returncode if returncode < 0 else returncode
    write_atomically(os.path.join(directory, "exit"), f"{code}\n")
    _close(ready_fd)
    return code


def parse(argv: list[str]) -> tuple[str, int | None, list[str]]:
    """(DIR, FD or None, command) from `--dir DIR [--ready-fd FD] -- CMD ARGS...`; ValueError says what is wrong."""
    options: dict[str, str] = {}
    rest = list(argv)
    while rest and rest[0] != "--":
        flag = rest.pop(0)
        if flag not in ("--dir", "--ready-fd"):
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
    return options["--dir"], None if fd is None else int(fd), rest[1:]


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):  # closed already
            os.close(fd)


def main() -> None:
    try:
        directory, ready_fd, command = parse(sys.argv[1:])
    except ValueError as err:
        sys.exit(f"shim.py: {err}\n{USAGE}")
    # A no-op handler, not SIG_IGN: an ignored signal stays ignored across exec, a handled one is reset, so
    # the worker still ends on SIGTERM while the shim survives signals meant for the agent.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    supervise(directory, command, ready_fd)


if __name__ == "__main__":
    main()
