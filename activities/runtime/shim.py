"""A tiny supervisor of one attempt, like conmon: it outlives the agent and records how its worker ended.

Run as `python -m activities.runtime.shim --dir DIR -- CMD ARGS...`; it writes DIR/pid, DIR/log and DIR/exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
from pathlib import Path


def write_atomically(path: Path, text: str) -> None:
    """Write `text` so that a reader sees the whole file or none of it."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def supervise(directory: Path, command: list[str]) -> int:
    """Run `command` in its own process group, wait for it, and record its exit code as a shell would."""
    with open(directory / "log", "ab") as log:
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
            write_atomically(directory / "pid", f"{child.pid}\n")
            # As in a container, what the worker leaves in its group ends with it. Kill the group before
            # reaping the worker: until then its id cannot be reused, so killpg names no one else's group.
            os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            returncode = child.wait()
            code = 128 - returncode if returncode < 0 else returncode
    write_atomically(directory / "exit", f"{code}\n")
    return code


def main() -> None:
    parser = argparse.ArgumentParser(prog="shim", description=__doc__)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    # A no-op handler, not SIG_IGN: an ignored signal stays ignored across exec, a handled one is reset, so
    # the worker still ends on SIGTERM while the shim survives signals meant for the agent.
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: None)
    supervise(args.dir, args.command)


if __name__ == "__main__":
    main()
