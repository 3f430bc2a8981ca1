"""`make demo`: the embedded default runs examples/hello.yaml from Pending to Completed, then stops."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from pathlib import Path

from workers.client import AstraeusClient
from workers.commands.inputs import load_spec
from workers.devserver import DevServerError, free_port
from workers.embedded import Embedded
from workers.render import render_describe, render_events

PORT_TRIES = 3


async def started(data_dir: Path) -> Embedded:
    """The embedded default on free ports. A port another process takes between our choice and the server's bind
    (a busy machine) fails the server's start: then new ports are chosen."""
    for attempt in range(1, PORT_TRIES + 1):
        embedded = Embedded(data_dir, port=free_port(), ui_port=free_port(), nodes=2, gpus="2xL4-24GB")
        try:
            return await embedded.__aenter__()
        except DevServerError as error:
            if "address already in use" not in str(error) or attempt == PORT_TRIES:
                raise
    raise AssertionError("unreachable")


async def demo(spec_path: str) -> int:
    spec = load_spec(spec_path)
    with tempfile.TemporaryDirectory(prefix="astraeus-demo-") as data_dir:
        async with contextlib.AsyncExitStack() as stack:
            embedded = await started(Path(data_dir))
            stack.push_async_exit(embedded)
            assert embedded.client is not None
            print(f"Temporal UI: {embedded.server.ui_address} (open while the demo runs)")
            print(f"Temporal frontend: {embedded.server.address}")
            client = AstraeusClient(embedded.client, control_build=embedded.control_build)
            await client.submit(spec)
            print(f"submitted {spec.namespace}/{spec.name}; its events as they happen:\n")
            async for event in client.follow(spec.namespace, spec.name):
                print(render_events([event]), flush=True)
            print()
            print(render_describe(await client.describe(spec.namespace, spec.name)))
            status = await client.status(spec.namespace, spec.name)
    print(f"\nThe run ended {status.state}: {status.reason}. The demo stopped everything it started.")
    return 0 if status.state == "Completed" else 1


def main() -> None:
    code = asyncio.run(demo(sys.argv[1] if len(sys.argv) > 1 else "examples/hello.yaml"))
    sys.stdout.flush()
    os._exit(code)  # skip interpreter finalization: see workers/cli.py main()


if __name__ == "__main__":
    main()
