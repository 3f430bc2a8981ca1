"""A script that uses the Python client ends cleanly. The Temporal SDK's client has no close of its own, and a process
that ends while it still holds a connection can crash on its way out (temporalio/sdk-python#300): here 7 runs in 10
of a script that lists workflows with a bare client died of SIGSEGV or SIGABRT after its work was done.
`async with AstraeusClient(...)` lets go of the connection first."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.devserver import DevServer, free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import asyncio
import sys

from workers.client import AstraeusClient
from workers.connect import connect


async def main() -> None:
    async with AstraeusClient(await connect(sys.argv[1])) as client:
        print(len((await client.ls()).runs))


asyncio.run(main())
"""


@pytest.fixture(scope="module")
def temporal(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = DevServer(tmp_path_factory.mktemp("temporal"), port=free_port(), ui_port=None)
    server.start()
    try:
        yield server.address
    finally:
        server.stop()


def test_a_script_using_the_client_in_async_with_ends_cleanly_every_time(temporal: str) -> None:
    codes = []
    for _ in range(10):
        ran = subprocess.run(
            [sys.executable, "-c", SCRIPT, temporal], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        codes.append((ran.returncode, ran.stdout, ran.stderr[-300:]))
    assert codes == [(0, "0\n", "")] * 10
