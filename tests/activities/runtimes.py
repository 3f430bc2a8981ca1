"""What the tests of both runtimes (processes and Docker containers) share: waiting for a worker to end, a readiness
check and probing until it passes, whether a process has ended, and killing what a test's process runtime left."""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path

from activities.agent.runtime.base import Observed, Runtime
from workflows.domain.group_parts import Readiness
from workflows.domain.refs import TaskRef


def wait_until_ended(runtime: Runtime, task_key: TaskRef, seconds: float = 20.0) -> Observed:
    deadline = time.monotonic() + seconds
    while (observed := runtime.observe(task_key)).running:
        assert time.monotonic() < deadline, f"{task_key.slug} still runs after {seconds} s"
        time.sleep(0.02)
    return observed


def has_ended(pid: int) -> bool:
    """Gone, or a zombie (an orphan's new parent may not reap it at once, or at all in a sandbox)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def check(command: list[str] | None = None, timeout: float = 2, **http_get: object) -> Readiness:
    return Readiness.model_validate(
        {"command": command, "http_get": http_get or None, "period_seconds": 1, "timeout_seconds": timeout}
    )


def probe_until(runtime: Runtime, task_key: TaskRef, readiness: Readiness, seconds: float = 10.0) -> str:
    """Probe until the check passes (a server needs a moment to listen); its detail."""
    deadline = time.monotonic() + seconds
    while not (result := runtime.probe(task_key, readiness))[0]:
        assert time.monotonic() < deadline, f"the check still fails after {seconds} s: {result[1]}"
        time.sleep(0.05)
    return result[1]


def kill_attempts(root: Path) -> None:
    """SIGKILL every worker (its process group) and shim a process runtime started under `root`, by pid."""
    for directory in root.glob("*"):
        for name, kill in (("pid", os.killpg), ("shim.pid", os.kill)):
            with suppress(FileNotFoundError, ValueError, ProcessLookupError, PermissionError):
                kill(int((directory / name).read_text()), signal.SIGKILL)
        with suppress(FileNotFoundError, ValueError, ChildProcessError):
            os.waitpid(int((directory / "shim.pid").read_text()), os.WNOHANG)
