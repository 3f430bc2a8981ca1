"""The invariants a burst must keep, pure: read from the runs' read-back and from the workers' processes alive at its
end (their environment, as the kernel holds it). No worker started twice, no GPU held by two workers, each worker
with the GPUs it asked for, and every run accounted for: Running with its one process alive where its run says, or
waiting for room with a reason of the vocabulary and no process. `bench.burst` gathers the inputs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bench.chaos_checks import CODES, WAITING_CODES, Interval, gpus_held_twice, started_twice, without_gpu

if TYPE_CHECKING:
    from bench.burst import Run

EXAMPLES = 3
GPUS = 1  # a burst run's one worker asks for one GPU


@dataclass
class Invariants:
    """What broke them, each a line naming the worker or run; empty lists: they held."""

    workers: int = 0  # worker processes alive at the end
    started_twice: list[str] = field(default_factory=list)
    gpus_held_twice: list[str] = field(default_factory=list)
    without_gpu: list[str] = field(default_factory=list)
    unaccounted: list[str] = field(default_factory=list)  # runs neither Running as they say nor waiting
    strays: list[str] = field(default_factory=list)  # processes alive of no run of the burst

    def counts(self) -> dict[str, int]:
        return {
            "workers_alive": self.workers,
            "started_twice": len(self.started_twice),
            "gpus_held_twice": len(self.gpus_held_twice),
            "without_gpu": len(self.without_gpu),
            "unaccounted": len(self.unaccounted),
            "strays": len(self.strays),
            "broken": self.broken,
        }

    @property
    def kinds(self) -> dict[str, list[str]]:
        return {
            "workers started twice": self.started_twice,
            "GPUs held by two workers": self.gpus_held_twice,
            "workers without the GPUs they asked for": self.without_gpu,
            "runs unaccounted for": self.unaccounted,
            "worker processes of no run": self.strays,
        }

    @property
    def broken(self) -> int:
        return sum(len(found) for found in self.kinds.values())


def check(runs: Sequence[Run], workers: Sequence[Interval], gpus: int) -> Invariants:
    """The burst's invariants, from its runs as read back and the worker processes alive (each asked `gpus`)."""
    found = Invariants(workers=len(workers))
    found.started_twice = [case.text for case in started_twice(workers).cases]
    found.gpus_held_twice = [case.text for case in gpus_held_twice(workers)]
    found.without_gpu = without_gpu(workers, gpus)
    alive: dict[str, list[Interval]] = {}
    for worker in workers:
        alive.setdefault(worker.run, []).append(worker)
    for run in runs:
        if run.submitted is None:
            continue
        name = f"{run.namespace}/{run.name}"
        why = unaccounted(run, alive.pop(name, []))
        if why is not None:
            found.unaccounted.append(f"{name}: {why}")
    found.strays = [f"{w.slug} on {w.node}" for left in alive.values() for w in left]
    return found


def unaccounted(run: Run, alive: Sequence[Interval]) -> str | None:
    """Why `run` is not accounted for by its read-back and its processes `alive`; None when it is."""
    if run.error:
        return run.error
    if run.code not in CODES or run.worker_code not in CODES:
        return f"a reason not of the vocabulary: {run.reason!r}, its worker {run.worker_reason!r}"
    if run.state == "Running":
        if run.worker_state != "Running":
            return f"Running, its worker {run.worker_state}: {run.worker_reason}"
        if len(alive) != 1:
            return f"Running, with {_processes(alive)} alive"
        process = alive[0]
        if (process.task, process.attempt, process.node) != (run.worker, run.attempt, run.node):
            return (
                f"its process is {process.task} attempt {process.attempt} on {process.node}, its run says "
                f"{run.worker} attempt {run.attempt} on {run.node}"
            )
        return None
    if run.state == "Pending":
        if alive:
            return f"Pending, with {_processes(alive)} alive"
        if run.worker_code not in WAITING_CODES:
            return f"Pending, its worker {run.worker_state}: {run.worker_reason}"
        return None
    return f"{run.state}: {run.reason}"


def _processes(alive: Sequence[Interval]) -> str:
    return f"{len(alive)} worker process" + ("" if len(alive) == 1 else "es")


def lines(found: Invariants) -> list[str]:
    """A line per kind that broke, with a few of its cases."""
    out = []
    for kind, cases in found.kinds.items():
        if cases:
            out.append(f"{len(cases):5d} x {kind}, e.g. {'; '.join(cases[:EXAMPLES])}")
    return out
