"""The Temporal server's own counters, from its Prometheus `/metrics`: the requests it served, the persistence
operations it made and the ones that failed, and how long its workflow writes took, between two scrapes.

They say what a run costs the server in its own units (a write per heartbeat, say), which the CPU figures cannot,
and they show the server falling behind: a write that takes longer than the caller waits fails ("context deadline
exceeded"), and a task the server recorded as started in such a write is never handed to a worker (bench/README.md,
"Lost tasks").
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
Sample = dict[tuple[str, Labels], float]

WRITE = "UpdateWorkflowExecution"  # a workflow's mutable state written: every task, signal and heartbeat
SHOWN = 6  # operations listed by name; the rest are counted in the total
SLOT = "ShardInfo"  # the history shard's I/O semaphore (`history.shardIOConcurrency`, 1): every write waits for it
LOCK = "HistoryCacheGetOrCreate"  # a workflow's lock, held from its load through its write
# The history's records of a task handed to a worker. One handed to a waiting poll (a sync match) must be recorded
# within 1 s (the matching engine's recordTaskStartedSyncMatchTimeout): a record that lands later is a task lost.
RECORDS = ("RecordActivityTaskStarted", "RecordWorkflowTaskStarted")
SYNC_MATCH_SECONDS = 1.0
QUIET_ERRORS = ("serviceerror_NotFound",)  # a task queue or record looked up before it exists: normal
LOGGED = re.compile(r'level=(WARN|ERROR) msg="([^"]*)"(?:.*?error="([^"]{0,60}))?')
FLUSH_SECONDS = 1.5  # the server publishes its counters about every second: a scrape sees them that late


# The families read; the server publishes thousands of series, and parsing them all took seconds of CPU
NEEDED = (
    "service_requests",
    "persistence_requests",
    "visibility_persistence_requests",
    "persistence_error_with_type",
    "persistence_latency",
    "visibility_persistence_latency",
    "service_latency",
    "semaphore_latency",
    "history_workflow_execution_cache_lock_hold_duration",
    "task_requests",
)
_NEEDED_LINES = NEEDED + tuple(f"# {kind} {name}" for kind in ("HELP", "TYPE") for name in NEEDED)


def scrape(port: int, timeout: float = 10) -> Sample:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as answer:
        return parse(answer.read().decode())


async def settled(port: int) -> Sample:
    """A scrape once what the server counted until now is published. It is read and parsed in a process of its own:
    in this one, parsing held the interpreter for seconds, which the control plane's workflow tasks waited out (a
    1,000-run burst's first workflow tasks timed out so, each time the bench scraped as the first 512 were Running)."""
    await asyncio.sleep(FLUSH_SECONDS)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.server_metrics", str(port), stdout=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"scraping the server's /metrics on port {port} failed (exit {process.returncode})")
    return {(name, tuple((k, v) for k, v in labels)): value for name, labels, value in json.loads(out)}


def parse(text: str) -> Sample:
    kept = "\n".join(line for line in text.splitlines() if line.startswith(_NEEDED_LINES))
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(kept)
        for s in family.samples
    }


@dataclass
class ServerOps:
    requests: collections.Counter[str] = field(default_factory=collections.Counter)  # frontend, by operation
    persistence: collections.Counter[str] = field(default_factory=collections.Counter)  # by operation
    visibility: collections.Counter[str] = field(default_factory=collections.Counter)  # the visibility store's
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # "operation: error type"
    write_ms: dict[str, float | None] = field(default_factory=dict)  # UpdateWorkflowExecution: p50, p99 (bucket)
    logged: collections.Counter[str] = field(default_factory=collections.Counter)  # its log's warnings and errors
    persistence_ms: collections.Counter[str] = field(default_factory=collections.Counter)  # by operation
    served_ms: collections.Counter[str] = field(default_factory=collections.Counter)  # frontend, by operation
    slot: list[float] = field(default_factory=lambda: [0.0, 0.0])  # the shard's I/O slot: ms waited, waits
    lock: list[float] = field(default_factory=lambda: [0.0, 0.0])  # workflows' locks: ms held, holds
    records: collections.Counter[str] = field(default_factory=collections.Counter)  # RECORDS, by operation
    late_records: collections.Counter[str] = field(default_factory=collections.Counter)  # over SYNC_MATCH_SECONDS
    # The history's own tasks, by type: its timers (an activity's heartbeat timeout fired: a write when the activity
    # heartbeated since, to arm the next), transfers and visibility records
    tasks: collections.Counter[str] = field(default_factory=collections.Counter)

    def figures(self, per: int) -> dict[str, Any]:
        per = max(per, 1)
        return {
            "requests_per_run": {k: v / per for k, v in self.requests.most_common()},
            "persistence_per_run": {k: v / per for k, v in self.persistence.most_common()},
            "visibility_per_run": {k: v / per for k, v in self.visibility.most_common()},
            "errors": dict(self.errors.most_common()),
            "write_ms": self.write_ms,
            "logged": dict(self.logged.most_common()),
            "persistence_ms_per_run": {k: v / per for k, v in self.persistence_ms.most_common()},
            "served_ms_per_request": {k: v / max(self.requests[k], 1) for k, v in self.served_ms.most_common()},
            "slot_waits_per_run": self.slot[1] / per,
            "slot_wait_ms": _mean(self.slot),
            "lock_held_ms": _mean(self.lock),
            "records": dict(self.records),
            "late_records": dict(self.late_records),
        }

    def rows(self, title: str, per: int) -> list[tuple[str, str]]:
        per = max(per, 1)
        p50, p99 = self.write_ms.get("p50"), self.write_ms.get("p99")
        errors = sum(self.errors.values())
        rows = [
            (f"{title}: requests, per run", _top(self.requests, per)),
            (f"{title}: persistence operations, per run", _top(self.persistence, per)),
            (f"{title}: visibility store operations, per run", _top(self.visibility, per)),
            (
                f"{title}: {WRITE}, p50 / p99 (ms, bucket bound)",
                f"{_ms(p50)} / {_ms(p99)}",
            ),
            (f"{title}: persistence errors", f"{errors}" + (f" ({_list(self.errors)})" if errors else "")),
            (f"{title}: persistence time, ms per run", _top(self.persistence_ms, per)),
            (f"{title}: time to serve a request, ms", _each(self.served_ms, self.requests)),
            (
                f"{title}: the shard's I/O slot: waits per run / mean wait; a workflow's lock held, mean",
                f"{self.slot[1] / per:.1f} / {_mean_ms(self.slot)}; {_mean_ms(self.lock)}",
            ),
        ]
        rows.append(
            (
                f"{title}: tasks recorded started: over {SYNC_MATCH_SECONDS:g} s / all",
                ", ".join(f"{k} {self.late_records[k]} / {self.records[k]}" for k in RECORDS),
            )
        )
        rows += [(f"{title}: logged", f"{n} x {what}") for what, n in self.logged.most_common(SHOWN)]
        return rows


def between(before: Sample, after: Sample) -> ServerOps:
    ops = ServerOps()
    buckets: dict[float, float] = collections.defaultdict(float)
    for (name, labels), value in after.items():
        grown = value - before.get((name, labels), 0.0)
        if grown <= 0:
            continue
        name, label = name.removesuffix("_total"), dict(labels)  # the parser names a counter's samples *_total
        operation = label.get("operation", "?")
        if name == "service_requests" and label.get("service_name") == "frontend":
            ops.requests[operation] += round(grown)
        elif name == "persistence_requests":
            ops.persistence[operation] += round(grown)
        elif name == "visibility_persistence_requests":
            ops.visibility[operation] += round(grown)
        elif name == "persistence_error_with_type" and label.get("error_type") not in QUIET_ERRORS:
            ops.errors[f"{operation}: {label.get('error_type', '?')}"] += round(grown)
        elif name == "persistence_latency_sum":
            ops.persistence_ms[operation] += round(grown * 1000)
        elif name == "visibility_persistence_latency_sum":
            ops.persistence_ms[f"visibility {operation}"] += round(grown * 1000)
        elif name == "service_latency_sum" and label.get("service_name") == "frontend":
            ops.served_ms[operation] += round(grown * 1000)
        elif name.startswith("semaphore_latency_") and operation == SLOT:
            _add_timer(ops.slot, name, grown)
        elif name.startswith("history_workflow_execution_cache_lock_hold_duration_") and operation == LOCK:
            _add_timer(ops.lock, name, grown)
        elif name == "task_requests" and label.get("service_name") == "history":
            ops.tasks[label.get("task_type", operation)] += round(grown)
        elif name == "persistence_latency_bucket" and operation == WRITE:
            buckets[float(label["le"])] += grown
        elif name == "service_latency_count" and label.get("service_name") == "history" and operation in RECORDS:
            ops.records[operation] += round(grown)
            ops.late_records[operation] += round(grown)  # less those within the deadline's bucket, below
        elif (
            name == "service_latency_bucket"
            and label.get("service_name") == "history"
            and operation in RECORDS
            and float(label["le"]) == SYNC_MATCH_SECONDS
        ):
            ops.late_records[operation] -= round(grown)
    ops.write_ms = {"p50": _quantile(buckets, 0.5), "p99": _quantile(buckets, 0.99)}
    return ops


def logged(log: Path, since: int) -> tuple[collections.Counter[str], int]:
    """The warnings and errors the server wrote in its log from byte `since` on, by level, message and error (a
    write that failed: "ERROR Update workflow execution operation failed. (context deadline exceeded)"); and
    where the log ends now."""
    with log.open("rb") as text:
        text.seek(since)
        lines = text.read().decode(errors="replace")
    found: collections.Counter[str] = collections.Counter()
    for match in LOGGED.finditer(lines):
        level, message, error = match.groups()
        found[f"{level} {message}" + (f" ({error})" if error else "")] += 1
    return found, since + len(lines.encode())


def _quantile(cumulative: dict[float, float], q: float) -> float | None:
    """The upper bound (ms) of the histogram bucket holding the q-quantile; None without samples."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    total = cumulative[bounds[-1]]
    return next(bound * 1000 for bound in bounds if cumulative[bound] >= q * total)


def _top(counter: collections.Counter[str], per: int) -> str:
    total = sum(counter.values()) / per
    shown = ", ".join(f"{k} {v / per:.1f}" for k, v in counter.most_common(SHOWN))
    return f"{total:.1f} ({shown})" if shown else "0"


def _each(total_ms: collections.Counter[str], calls: collections.Counter[str]) -> str:
    """The mean time of the most frequent calls: `Start 300, Signal 140`."""
    shown = [(k, total_ms[k] / n) for k, n in calls.most_common() if total_ms.get(k) and not k.startswith("Poll")]
    return ", ".join(f"{k} {v:.0f}" for k, v in shown[:SHOWN]) or "n/a"


def _add_timer(total_and_count: list[float], name: str, grown: float) -> None:
    """A timer's growth: its `_sum` (seconds, kept in ms) or its `_count`; its buckets are not read."""
    if name.endswith("_sum"):
        total_and_count[0] += grown * 1000
    elif name.endswith("_count"):
        total_and_count[1] += grown


def _mean(total_and_count: list[float]) -> float | None:
    total, count = total_and_count
    return total / count if count else None


def _mean_ms(total_and_count: list[float]) -> str:
    mean = _mean(total_and_count)
    return "n/a" if mean is None else f"{mean:.1f} ms"


def _list(counter: collections.Counter[str]) -> str:
    return ", ".join(f"{v:.0f} x {k}" for k, v in counter.most_common(SHOWN))


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "> the largest bucket" if value == float("inf") else f"{value:g}"


if __name__ == "__main__":  # python -m bench.server_metrics PORT: the needed samples as JSON, for settled()
    json.dump([[name, labels, value] for (name, labels), value in scrape(int(sys.argv[1])).items()], sys.stdout)
