"""Container start latency: from the docker runtime's start (find, image check, create, start) to Running.

Starts its own Docker engine (as the tests do) unless given `--docker-host`, runs `--count` containers of
local/busybox one after the other, and prints the spread of each phase, with the process runtime beside it.
Prints figures; never a timed test.

    python -m bench.containers [--count 30] [--docker-host unix:///var/run/docker.sock]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from activities.agent.runtime.base import Launch
from activities.agent.runtime.docker import DockerRuntime
from activities.agent.runtime.process import ProcessRuntime
from tests.docker_engine import IMAGE, DockerEngine, missing
from workflows.domain.refs import TaskRef


def measure_docker(runtime: DockerRuntime, count: int) -> dict[str, list[float]]:
    """Seconds for `start` to return, and from its call until the engine reports the container running."""
    figures: dict[str, list[float]] = {"start returns": [], "start to Running": []}
    keys = []
    for attempt in range(1, count + 1):
        key = TaskRef(namespace="bench", job=f"latency-{time.time_ns()}", task_id="w-0", attempt=attempt)
        began = time.perf_counter()
        runtime.start(key, Launch(command=["sleep", "30"], image=IMAGE, memory_bytes=64 << 20, cpu=0.5))
        figures["start returns"].append(time.perf_counter() - began)
        while not runtime.observe(key).running:
            time.sleep(0.001)
        figures["start to Running"].append(time.perf_counter() - began)
        keys.append(key)
    for key in keys:
        runtime.stop(key, grace_seconds=0)
        runtime.delete(key)
    return figures


def measure_process(root: Path, count: int) -> dict[str, list[float]]:
    runtime = ProcessRuntime(root)
    figures: dict[str, list[float]] = {"start returns": []}
    for attempt in range(1, count + 1):
        key = TaskRef(namespace="bench", job="latency", task_id="w-0", attempt=attempt)
        began = time.perf_counter()
        runtime.start(key, Launch(command=["sleep", "30"]))
        figures["start returns"].append(time.perf_counter() - began)
        runtime.stop(key, grace_seconds=0)
    return figures


def report(title: str, figures: dict[str, list[float]]) -> None:
    print(title)
    for phase, seconds in figures.items():
        ordered = sorted(seconds)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        print(
            f"  {phase:<18} median {statistics.median(ordered) * 1000:7.1f} ms   p90 {p90 * 1000:7.1f} ms   "
            f"min {ordered[0] * 1000:7.1f} ms   max {ordered[-1] * 1000:7.1f} ms   (n={len(ordered)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--docker-host", help="an engine that has local/busybox:latest (default: start one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="astraeus-bench-") as tmp:
        engine = None
        host = args.docker_host
        if host is None:
            why = missing()
            if why is not None:
                raise SystemExit(f"cannot start a Docker engine: {why}")
            engine = DockerEngine(Path(tmp) / "docker")
            began = time.perf_counter()
            engine.start()
            print(f"dockerd ready and {IMAGE} imported in {time.perf_counter() - began:.2f} s")
            host = engine.host
        try:
            runtime = DockerRuntime("bench", host)
            measure_docker(runtime, 3)  # warm the engine's caches
            report(
                f"docker runtime, {args.count} containers of {IMAGE}, one at a time:",
                measure_docker(runtime, args.count),
            )
            runtime.close()
            report(
                f"process runtime, {args.count} processes, for comparison:",
                measure_process(Path(tmp) / "p", args.count),
            )
        finally:
            if engine is not None:
                engine.stop()


if __name__ == "__main__":
    main()
