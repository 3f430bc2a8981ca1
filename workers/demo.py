"""`make demo`: the embedded default runs examples/hello.yaml from Pending to Completed, then stops."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from pathlib import Path

from workers.cli import load_spec
from workers.client import AstraeusClient
from workers.devserver import free_port
from workers.embedded import Embedded
from workers.render import render_describe, render_events


async def demo(spec_path: str) -> int:
    spec = load_spec(spec_path)
    with tempfile.TemporaryDirectory(prefix="astraeus-demo-") as data_dir:
        embedded = Embedded(Path(data_dir), port=free_port(), ui_port=free_port(), nodes=2, gpus="2xL4-24GB")
        async with embedded:
            assert embedded.client is not None
            print(f"Temporal UI: {embedded.server.ui_address} (open while the demo runs)")
            print(f"Temporal frontend: {embedded.server.address}")
            client = AstraeusClient(embedded.client)
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
