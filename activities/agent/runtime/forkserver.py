"""The agent's end of the shims' fork server (`shim.py --serve`).

Each worker runs under a shim of its own, which outlives the agent. Started as a fresh interpreter, a shim cost 13
to 16 ms of CPU (Python's start-up), more than the rest of a worker's start; forked from a small server that has
started once, it costs about 3 ms. The server is the runtime's child, in a session of its own, started when the
agent starts (`start`; else at the first spawn) and again should it die; it exits when this end closes (the runtime
is collected, or the agent exits), and the shims it forked live on.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import weakref
from pathlib import Path

_SHIM = Path(__file__).resolve().with_name("shim.py")
_END_SECONDS = 5.0


class ForkServerError(Exception):
    """The server could not fork a shim, or died before it said whether it had."""


class ForkServer:
    """Forks shims on request; safe to call from several threads (requests go one at a time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None
        self._finalizer: weakref.finalize[[socket.socket, subprocess.Popen[bytes]], ForkServer] | None = None

    def spawn(self, directory: Path, command: list[str], env: dict[str, str], cgroup: Path | None, ready: int) -> int:
        """Fork a shim for the attempt in `directory`: it writes its pid there (before this returns), starts
        `command` with `env` (in `cgroup`, if given) and closes `ready` (the write end of the agent's pipe, sent to
        it here; the caller keeps and closes its own copy). Returns the shim's pid. A request the server may have
        taken is never sent again: the shim it forked would start the worker twice."""
        request = json.dumps(
            {"dir": str(directory), "command": command, "env": env, "cgroup": None if cgroup is None else str(cgroup)}
        ).encode()
        with self._lock:
            channel = self._channel()
            try:
                socket.send_fds(channel, [request], [ready])
            except OSError:  # it died since its last answer, before taking this one: a new one takes it
                self._end()
                channel = self._channel()
                socket.send_fds(channel, [request], [ready])
            try:
                answer = channel.recv(4096)
            except OSError as err:
                answer = str(err).encode()
            if not answer.startswith(b"{"):
                self._end()
                raise ForkServerError(f"the shims' fork server ended before it answered ({answer.decode() or 'EOF'})")
        said = json.loads(answer)
        if "error" in said:
            raise ForkServerError(f"the shims' fork server could not fork a shim: {said['error']}")
        return int(said["pid"])

    def start(self) -> None:
        """Start the server now, rather than at the first spawn: it starts an interpreter (about 30 ms of CPU), which
        a machine's first worker then does not wait for, nor a burst's starts pay for. Returns at once."""
        with self._lock:
            self._channel()

    def close(self) -> None:
        """End the server: it exits once its end of the socket reads closed (its shims live on)."""
        with self._lock:
            self._end()

    def _end(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._socket, self._finalizer = None, None

    def _channel(self) -> socket.socket:
        if self._socket is None:
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            with theirs:
                process = subprocess.Popen(
                    [sys.executable, "-I", "-S", str(_SHIM), "--serve"], stdin=theirs.fileno(), start_new_session=True
                )
            self._socket = ours
            self._finalizer = weakref.finalize(self, _end, ours, process)
        return self._socket


def _end(channel: socket.socket, process: subprocess.Popen[bytes]) -> None:
    """Close the server's socket and wait for it to exit, killing it (by its pid) should it not."""
    channel.close()
    try:
        process.wait(timeout=_END_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
