"""The embedded Temporal server's guards and settings: taken ports refuse the start, a port is known to be served by
the process that listens on it, not by whoever else answers there, and the server runs as `workers/devserver.py`
says (its search attributes cached, one partition per task queue)."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from temporalio.common import SearchAttributePair, TypedSearchAttributes

from bench.server_metrics import FLUSH_SECONDS, scrape
from workers.connect import connect
from workers.devserver import DevServer, DevServerError, free_port, owns_listener, port_free
from workflows.contracts import STATE_KEY


def test_free_ports_are_below_the_ephemeral_range_free_and_not_handed_out_twice() -> None:
    """A port the kernel could hand to another process's `bind(0)` (another dev server's inner ports) before our
    server listens is never chosen: CI once saw a dev server's port taken so."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(10_000 <= port < low and port_free(port) for port in ports)


def test_a_taken_port_refuses_the_start_before_anything_is_made(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ui = free_port()
        assert (port_free(port), port_free(ui)) == (False, True)
        with pytest.raises(DevServerError) as refused:
            DevServer(tmp_path / "data", port=port, ui_port=ui).start()
    assert str(refused.value) == (
        f"port {port} (Temporal frontend) on 127.0.0.1 is in use, by another `astraeus dev` or Temporal server "
        "perhaps: stop it, or choose other ports with --port and --ui-port"
    )
    assert not (tmp_path / "data").exists()


def test_a_server_that_panics_at_its_start_is_reported_by_its_panic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Go panic ends its log with a stack whose last line says nothing: the error quotes the panic itself. (A
    stand-in for the binary: the real one cannot be made to panic on demand.)"""
    panicking = tmp_path / "temporal"
    panicking.write_text(
        "#!/bin/sh\n"
        "echo 'panic: listen tcp 127.0.0.1:7234: bind: address already in use'\n"
        "echo\n"
        "echo 'goroutine 1 [running]:'\n"
        "echo 'main.main()'\n"
        "echo '\t/home/runner/work/cli/cli/cmd/temporal/main.go:18 +0x8e'\n"
        "exit 2\n"
    )
    panicking.chmod(0o755)
    monkeypatch.setattr("workers.devserver.temporal_binary", lambda: str(panicking))
    server = DevServer(tmp_path / "data", port=free_port(), ui_port=None)

    with pytest.raises(DevServerError) as refused:
        server.start()

    log = tmp_path / "data" / "temporal.log"
    assert str(refused.value) == (
        "the Temporal dev server exited with code 2: panic: listen tcp 127.0.0.1:7234: bind: address already in use "
        f"(its log: {log})"
    )


def test_the_listener_of_a_port_is_told_from_another_process() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert (owns_listener(os.getpid(), port), owns_listener(other.pid, port)) == (True, False)
        finally:
            other.kill()
            other.wait()


def test_a_data_dir_in_use_by_a_running_server_refuses_a_second_one(tmp_path: Path) -> None:
    first = DevServer(tmp_path, port=free_port(), ui_port=None)
    first._lock_data_dir()
    try:
        with pytest.raises(DevServerError) as refused:
            DevServer(tmp_path, port=free_port(), ui_port=None).start()
        assert str(refused.value) == (
            f"{tmp_path} is in use by astraeus dev (pid {os.getpid()}): stop it, or choose another --data-dir"
        )
    finally:
        first.stop()
    again = DevServer(tmp_path, port=free_port(), ui_port=None)
    again._lock_data_dir()  # free again once the first stopped
    again.stop()


def test_the_server_keeps_its_search_attributes_cached(tmp_path: Path) -> None:
    """Starts that carry our search attributes read the cluster's metadata from the database no more: with the dev
    server's own default (no cache) each start read it at least once."""
    server = DevServer(tmp_path, port=free_port(), ui_port=None, metrics_port=free_port())
    server.start()
    try:
        assert server.metrics_port is not None
        asyncio.run(_start_workflows(server.address, 3))  # the first uses fill the cache
        time.sleep(FLUSH_SECONDS)
        before = _metadata_reads(scrape(server.metrics_port))
        asyncio.run(_start_workflows(server.address, 20))
        time.sleep(FLUSH_SECONDS)
        after = _metadata_reads(scrape(server.metrics_port))
    finally:
        server.stop()
    assert after - before < 5, f"{after - before} reads of the cluster's metadata for 20 starts"


def test_each_task_queue_is_one_partition(tmp_path: Path) -> None:
    """Tasks added to a queue all go to its one partition: with the server's default of 4, a task could wait in a
    partition where no poll waits (bench/README.md). 20 starts on 4 partitions would all land on the first one
    with a chance of 4 ** -19."""
    server = DevServer(tmp_path, port=free_port(), ui_port=None, metrics_port=free_port())
    server.start()
    try:
        queue = f"nobody-{uuid.uuid4().hex}"
        asyncio.run(_start_workflows(server.address, 20, queue))
        time.sleep(FLUSH_SECONDS)
        assert server.metrics_port is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    finally:
        server.stop()
    ours = [line for line in text.splitlines() if f'taskqueue="{queue.replace("-", "_")}"' in line]
    assert ours, "the server's metrics name no partition of the queue"
    assert set(re.findall(r'partition="(\d+)"', "\n".join(ours))) == {"0"}


async def _start_workflows(address: str, count: int, queue: str | None = None) -> None:
    client = await connect(address, wait=timedelta(seconds=30))
    queue = queue or f"nobody-{uuid.uuid4().hex}"  # no worker: the starts alone are measured
    for _ in range(count):
        await client.start_workflow(
            "Nothing",
            id=f"start-{uuid.uuid4().hex}",
            task_queue=queue,
            search_attributes=TypedSearchAttributes([SearchAttributePair(STATE_KEY, "Pending")]),
        )


def _metadata_reads(sample: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return sum(
        value
        for (name, labels), value in sample.items()
        if name.startswith("persistence_requests") and dict(labels).get("operation") == "GetCurrentClusterMetadata"
    )
