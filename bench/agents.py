"""Several node agents in one process, for benchmarks: `python -m bench.agents --temporal HOST:PORT --data-dir DIR
--first I --count K [--gpus 8xH100-80GB] [--cpus C] [--memory-bytes B] [--settings FILE]`.

Each agent is what `astraeus agent` runs (`workers.services.start_agent`: its own inventory, process runtime,
task queue and registration), named `<prefix>-<i>` with its files under `DIR/<name>`; they share this process's
event loop and its one Temporal client. SIGTERM or SIGINT shuts every agent's worker down; the workers' processes
(each attempt's shim) outlive it, as they outlive a real agent.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from bench.common import run_and_exit
from workers.agent_process import AgentOptions, start_agent
from workers.commands.inputs import load_settings
from workers.connect import connect


def machine_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:03d}"


async def serve(args: argparse.Namespace) -> None:
    client = await connect(args.temporal, wait=timedelta(seconds=30))
    settings = load_settings(args.settings)
    options = [
        AgentOptions(
            name=machine_name(args.prefix, i),
            data_dir=Path(args.data_dir) / machine_name(args.prefix, i),
            gpus=args.gpus,
            cpus=args.cpus,
            memory_bytes=args.memory_bytes,
        )
        for i in range(args.first, args.first + args.count)
    ]
    workers = await asyncio.gather(*(start_agent(client, o, settings) for o in options))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    running = [asyncio.ensure_future(w.run()) for w in workers]
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopping, *running], return_when=asyncio.FIRST_COMPLETED)
    await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
    await asyncio.gather(*running, return_exceptions=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.agents", description=__doc__.splitlines()[0])
    p.add_argument("--temporal", required=True, help="Temporal frontend HOST:PORT")
    p.add_argument("--data-dir", required=True, help="each agent's files go under DIR/<name>")
    p.add_argument("--prefix", default="m", help="machine names are <prefix>-<index> (default m)")
    p.add_argument("--first", type=int, default=0, help="index of the first machine (default 0)")
    p.add_argument("--count", type=int, default=1, help="agents in this process (default 1)")
    p.add_argument("--gpus", help="GPUs each machine declares, e.g. 8xH100-80GB")
    p.add_argument("--cpus", type=float, help="CPU cores each machine offers")
    p.add_argument("--memory-bytes", type=int, help="memory each machine offers")
    p.add_argument("--settings", help="YAML file overriding the spec's timers (as `astraeus agent --settings`)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    profile = os.environ.get("ASTRAEUS_BENCH_PROFILE")
    if profile:
        _profile_on_signals(profile)
    run_and_exit(serve(args), "bench.agents")


def _profile_on_signals(path: str) -> None:
    """With ASTRAEUS_BENCH_PROFILE=<file>: SIGUSR1 starts a cProfile of this process, SIGUSR2 stops it and writes its
    stats to the file (to profile a window, the burst's steady state say, from outside)."""
    import cProfile

    profiler = cProfile.Profile()

    def stop(*_: object) -> None:
        profiler.disable()
        profiler.dump_stats(path)

    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, stop)


if __name__ == "__main__":
    main()
