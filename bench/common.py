"""What the benchmarks share: clocks and percentiles, CPU time of a process, reading a Temporal event history,
waiting for machines, and the two-column table they print."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import json
import logging
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from temporalio.api.enums.v1 import EventType, TimeoutType, WorkflowTaskFailedCause
from temporalio.api.history.v1 import HistoryEvent

from workers import collector
from workers.client import AstraeusClient
from workflows.domain.inventory import NodeState

WORKFLOW_TASK_PROBLEMS = (EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED, EventType.EVENT_TYPE_WORKFLOW_TASK_TIMED_OUT)


def run_and_exit(work: Coroutine[Any, Any, list[str] | None], name: str = "bench", show_load: bool = False) -> NoReturn:
    """Run a benchmark's coroutine (logging warnings; with `show_load`, first saying the load average, since the
    machine is shared), print the lines it returns, and exit: 143 when SIGTERM stopped it, 1 on an error (said on
    stderr), skipping interpreter finalization (see workers/cli.py main()). The benchmark's processes hold the
    services, so their garbage collector is set as the services' is (workers/collector.py)."""
    collector.tune()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if show_load:
        print(f"load average at the start: {os.getloadavg()[0]:.2f}", file=sys.stderr)
    code = 0
    try:
        lines = asyncio.run(work)
        if lines is not None:
            print("\n".join(lines))
    except asyncio.CancelledError:
        print(f"{name}: stopped by SIGTERM", file=sys.stderr)
        code = 143
    except Exception as error:
        print(f"{name}: {type(error).__name__}: {error}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Pauses:
    """The garbage collector's collections in this process while `counting` (gc.callbacks): their CPU time (of the
    thread collecting) and the longest pause (wall clock: the collector holds the interpreter throughout)."""

    collections: list[int] = field(default_factory=lambda: [0, 0, 0])  # by generation
    seconds: float = 0.0  # CPU
    longest: float = 0.0  # wall clock
    _began: tuple[float, float] = (0.0, 0.0)

    @contextlib.contextmanager
    def counting(self) -> Iterator[Pauses]:
        gc.callbacks.append(self._callback)
        try:
            yield self
        finally:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = (time.thread_time(), time.perf_counter())
            return
        self.collections[info["generation"]] += 1
        self.seconds += time.thread_time() - self._began[0]
        self.longest = max(self.longest, time.perf_counter() - self._began[1])

    def text(self) -> str:
        young, middle, full = self.collections
        return f"{young + middle + full} ({full} full) / {self.seconds * 1000:.0f} / {self.longest * 1000:.0f}"


def now() -> datetime:
    return datetime.now(UTC)


def span(times: Iterable[datetime | None]) -> float | None:
    """Seconds from the first of `times` to the last (those present); None when none is."""
    present = [t for t in times if t is not None]
    return (max(present) - min(present)).total_seconds() if present else None


def ms(later: datetime | None, earlier: datetime | None) -> float | None:
    if later is None or earlier is None:
        return None
    return (later - earlier).total_seconds() * 1000


def percentile(values: Iterable[float], p: float) -> float:
    """Nearest rank: the smallest value at or above p percent of the values."""
    ordered = sorted(values)
    return ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)]


def summary(values: list[float | None]) -> dict[str, float | None]:
    """Median, p99 and max of the values present (None each when none is)."""
    present = [v for v in values if v is not None]
    if not present:
        return {"p50": None, "p99": None, "max": None}
    return {"p50": statistics.median(present), "p99": percentile(present, 99), "max": max(present)}


def fmt_latency(values: list[float | None]) -> str:
    """`median / p99 / max` in ms, and how many had no value."""
    present = [v for v in values if v is not None]
    if not present:
        return "n/a"
    text = f"{statistics.median(present):7.0f} / {percentile(present, 99):7.0f} / {max(present):7.0f}"
    missing = len(values) - len(present)
    return text + (f"  ({missing} runs without one)" if missing else "")


def table(rows: list[tuple[str, str]]) -> list[str]:
    """Two columns: the label padded to the longest one, then the value."""
    width = max((len(k) for k, _ in rows), default=0)
    return [f"{k.ljust(width)}  {v}".rstrip() for k, v in rows]


def latency_rows(title: str, labelled: Iterable[tuple[str, float]]) -> list[tuple[str, str]]:
    """One row per label (in first-seen order) with its median / p99 / max, under a title row."""
    groups: dict[str, list[float | None]] = {}
    for label, value in labelled:
        groups.setdefault(label, []).append(value)
    if not groups:
        return []
    return [(f"{title}, median / p99 / max (ms):", "")] + [(f"  {k}", fmt_latency(v)) for k, v in groups.items()]


# ---- CPU -------------------------------------------------------------------------------------------------------


def own_cpu_seconds() -> float:
    """CPU time of this process so far, every thread (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3, the state, is [0]); None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def pid_cpu_seconds(pid: int | None, children: bool = False) -> float:
    """CPU time of process `pid` (utime + stime, all its threads), with `children` also that of its children
    it has reaped; 0 when it is gone."""
    fields = proc_stat(pid) if pid is not None else None
    if fields is None:
        return 0.0
    with contextlib.suppress(IndexError, ValueError):
        ticks = int(fields[11]) + int(fields[12]) + (int(fields[13]) + int(fields[14]) if children else 0)
        return ticks / os.sysconf("SC_CLK_TCK")
    return 0.0


def children_of(parents: set[int]) -> list[int]:
    """The live processes (not zombies) whose parent is one of `parents`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = proc_stat(int(entry.name))
        if fields is not None and len(fields) > 1 and fields[0] != "Z" and int(fields[1]) in parents:
            found.append(int(entry.name))
    return found


# ---- event histories -------------------------------------------------------------------------------------------


@dataclass
class HistoryFigures:
    """What one workflow's Temporal event history tells."""

    events: int = 0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)  # events by kind
    phases: list[tuple[str, float]] = field(default_factory=list)  # activities, workflow tasks: queued, ran (ms)
    activity_retries: list[tuple[str, str]] = field(default_factory=list)  # (activity, last failure): attempt > 1
    activity_problems: list[str] = field(default_factory=list)  # activities that timed out or failed for good
    workflow_task_problems: list[str] = field(default_factory=list)  # workflow tasks that failed or timed out


def read_history(events: Iterable[HistoryEvent]) -> HistoryFigures:
    """Counts by kind, each activity's and workflow task's queued (scheduled -> started) and ran (started ->
    completed) times, activities started more than once, and what failed or timed out."""
    figures = HistoryFigures()
    scheduled: dict[int, tuple[str, datetime]] = {}  # activities and workflow tasks, by scheduled event id
    started: dict[int, datetime] = {}
    last_activity: tuple[str, datetime] | None = None  # the last activity scheduled, and when
    signaled: datetime | None = None  # the last signal not yet followed by a workflow task's start
    cause = "nothing"  # the last event that was not a workflow task's
    for event in events:
        figures.events += 1
        at = event.event_time.ToDatetime(tzinfo=UTC)
        figures.counts[EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")] += 1
        if event.HasField("activity_task_scheduled_event_attributes"):
            scheduled[event.event_id] = (event.activity_task_scheduled_event_attributes.activity_type.name, at)
            last_activity = scheduled[event.event_id]
        elif event.HasField("workflow_task_scheduled_event_attributes"):
            # A run's first task (from the shared queue, creating its instance) apart from the others (sticky)
            scheduled[event.event_id] = ("workflow task" if scheduled else "first workflow task", at)
        elif event.HasField("activity_task_started_event_attributes"):
            activity = event.activity_task_started_event_attributes
            name, when = scheduled.get(activity.scheduled_event_id, ("?", at))
            started[activity.scheduled_event_id] = at
            figures.phases.append((f"{name}: queued", ms(at, when) or 0.0))
            if activity.attempt > 1:
                why = activity.last_failure.message[:200] or "no failure recorded"
                figures.activity_retries.append((name, why))
        elif event.HasField("workflow_execution_signaled_event_attributes"):
            signal = event.workflow_execution_signaled_event_attributes.signal_name
            if last_activity is not None:
                figures.phases.append(
                    (f"{last_activity[0]} scheduled -> {signal} signal", ms(at, last_activity[1]) or 0.0)
                )
            signaled = at
        elif event.HasField("workflow_task_started_event_attributes"):
            wft = event.workflow_task_started_event_attributes
            if signaled is not None:
                figures.phases.append(("signal -> workflow task started", ms(at, signaled) or 0.0))
                signaled = None
            started[wft.scheduled_event_id] = at
            kind = scheduled[wft.scheduled_event_id][0]
            figures.phases.append((f"{kind}: queued", ms(at, scheduled[wft.scheduled_event_id][1]) or 0.0))
        elif event.HasField("activity_task_completed_event_attributes"):
            done = event.activity_task_completed_event_attributes.scheduled_event_id
            if done in started:
                figures.phases.append((f"{scheduled[done][0]}: ran", ms(at, started[done]) or 0.0))
        elif event.HasField("workflow_task_completed_event_attributes"):
            done = event.workflow_task_completed_event_attributes.scheduled_event_id
            if done in started:
                figures.phases.append((f"{scheduled[done][0]}: ran", ms(at, started[done]) or 0.0))
        elif event.HasField("activity_task_timed_out_event_attributes"):
            attributes = event.activity_task_timed_out_event_attributes
            name = scheduled.get(attributes.scheduled_event_id, ("?", at))[0]
            figures.activity_problems.append(f"{name} timed out ({attributes.failure.message[:200]})")
        elif event.HasField("activity_task_failed_event_attributes"):
            attributes_failed = event.activity_task_failed_event_attributes
            name = scheduled.get(attributes_failed.scheduled_event_id, ("?", at))[0]
            figures.activity_problems.append(f"{name} failed ({attributes_failed.failure.message[:200]})")
        elif event.HasField("marker_recorded_event_attributes"):
            local = _local_activity(event)
            if local is not None and local[1] > 1:
                figures.activity_retries.append((f"{local[0]} (local)", f"attempt {local[1]}"))
        if event.event_type in WORKFLOW_TASK_PROBLEMS:
            figures.workflow_task_problems.append(f"{describe_problem(event)}, after {cause}")
        elif not EventType.Name(event.event_type).startswith("EVENT_TYPE_WORKFLOW_TASK_"):
            cause = EventType.Name(event.event_type).removeprefix("EVENT_TYPE_")  # what the next task answers
    return figures


def _local_activity(event: HistoryEvent) -> tuple[str, int] | None:
    """A local activity's name and the attempt that finished it, from its marker (the SDK's own JSON)."""
    marker = event.marker_recorded_event_attributes
    if marker.marker_name != "core_local_activity" or "data" not in marker.details:
        return None
    data = json.loads(marker.details["data"].payloads[0].data)
    return str(data.get("activity_type", "?")), int(data.get("attempt", 1))


def describe_problem(event: HistoryEvent) -> str:
    """`workflow task TIMED_OUT (START_TO_CLOSE)` or `workflow task FAILED (cause: message)`."""
    text = f"workflow task {EventType.Name(event.event_type).removeprefix('EVENT_TYPE_WORKFLOW_TASK_')}"
    if event.HasField("workflow_task_timed_out_event_attributes"):
        kind = event.workflow_task_timed_out_event_attributes.timeout_type
        text += f" ({TimeoutType.Name(kind).removeprefix('TIMEOUT_TYPE_')})"
    if event.HasField("workflow_task_failed_event_attributes"):
        attributes = event.workflow_task_failed_event_attributes
        cause = WorkflowTaskFailedCause.Name(attributes.cause).removeprefix("WORKFLOW_TASK_FAILED_CAUSE_")
        text += f" ({cause}: {attributes.failure.message[:200]})"
    return text


# ---- the cluster -----------------------------------------------------------------------------------------------


async def wait_for_machines(client: AstraeusClient, count: int, timeout: float = 60) -> None:
    """Until `count` machines are Ready with their inventory."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = await client.nodes()
        ready = [n for n in nodes if n.state == NodeState.READY and n.inventory is not None]
        if len(ready) >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(ready)} of {count} machines registered in {timeout} s")
        await asyncio.sleep(0.2)
