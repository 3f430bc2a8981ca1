"""What `bench.burst` prints (a two-column table) and writes with `--json` (the same figures as data)."""

from __future__ import annotations

import collections
import os
import re
import statistics
from typing import TYPE_CHECKING, Any

from bench import burst_checks
from bench.common import fmt_latency, latency_rows, ms, percentile, span, summary, table

if TYPE_CHECKING:
    from bench.burst import Burst, Run

COUNTED = (
    "WORKFLOW_TASK_COMPLETED",
    "ACTIVITY_TASK_SCHEDULED",
    "WORKFLOW_EXECUTION_SIGNALED",
    "UPSERT_WORKFLOW_SEARCH_ATTRIBUTES",
)
RUN_NAME = re.compile(r"\b(?:[a-z0-9-]+/)?(?:run-\d{4}|idle-\d{3})\b")
WHEN = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(?::\d\d(?:\.\d+)?)?")
NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")
EXAMPLES = 3
ENDED = ("Completed", "Failed", "Cancelled")


def pattern(reason: str) -> str:
    """A reason with its run names, times and numbers replaced, so that runs waiting for one cause group."""
    return NUMBER.sub("n", WHEN.sub("<time>", RUN_NAME.sub("<run>", reason)))


def figures(b: Burst) -> dict[str, Any]:
    o = b.options
    submitted = [r for r in b.runs if r.submitted is not None and not r.error]
    first = min((r.submitted for r in submitted if r.submitted), default=None)
    running = sorted((r for r in b.runs if r.running_at is not None), key=lambda r: r.running_at or 0)
    waiting = [r for r in submitted if r.running_at is None]
    latencies = [v for r in running if (v := ms(r.running_at, r.submitted)) is not None]
    all_running = ms(running[o.target - 1].running_at, first) if len(running) >= o.target else None
    p50 = statistics.median(latencies) if latencies else None
    p99 = percentile(latencies, 99) if latencies else None
    floor = b.floor.figures() if b.floor else None
    floor_wall = floor["wall_seconds"] if floor else None
    # The scheduler's queue order at equal priority: the run's claim (its creation), then its id.
    by_claim = sorted((r for r in submitted if r.created_at), key=lambda r: (r.created_at, r.name))[: o.target]
    idle = [v for r in b.idle if (v := ms(r.running_at, r.submitted)) is not None]
    cpu_per_run = {k: v * 1000 / max(len(submitted), 1) for k, v in b.cpu.items()}
    cpu_per_run["ours"] = sum(v for k, v in cpu_per_run.items() if k != "server")
    return {
        "options": {k: str(v) if k in ("json_path", "data_dir") else v for k, v in vars(o).items()},
        "machines": o.machines,
        "gpus": o.machines * o.gpus,
        "agent_processes": b.agent_processes,
        "load_average": {"start": b.load[0], "end": b.load[1]},
        "submitted": len(submitted),
        "running": len(running),
        "running_seen_by_visibility": b.running_seen,
        "states": dict(collections.Counter(r.state for r in b.runs)),
        "all_running_seconds": all_running / 1000 if all_running is not None else None,
        "submit_span_seconds": span(r.submitted for r in submitted),
        "submit_rpc_ms": summary([r.submit_ms for r in submitted]),
        "submit_to_running_ms": {"p50": p50, "p99": p99, "max": max(latencies, default=None)},
        "p99_over_p50": p99 / p50 if p50 and p99 is not None else None,
        "idle_submit_to_running_ms": {"p50": statistics.median(idle) if idle else None, "each": idle},
        "running_among_first_by_claim": sum(1 for r in by_claim if r.running_at is not None),
        "events_per_run": _events(running),
        "events_per_waiting_run": _events(waiting),
        "per_run_counts": {k: _mean([r.history.counts[k] for r in running if r.history]) for k in COUNTED},
        "machine_workflow_events_per_run": b.machine_events / max(len(submitted), 1),
        "problems": _problems(b),
        "invariants": _invariants(b),
        "cpu_ms_per_run": cpu_per_run,
        "cpu_seconds": b.cpu,
        "server": b.server.figures(len(submitted)),
        "workers_cpu_ms_per_worker": b.workers_cpu[0] * 1000 / max(b.workers_cpu[1], 1),
        "workers_alive": b.workers_cpu[1],
        "reasons_now": _reasons([[r.reason] for r in waiting if r.state not in ENDED]),
        "reasons_ended": _reasons([[r.reason] for r in submitted if r.state in ENDED]),
        "reasons_seen_while_waiting": _reasons([r.reasons_waited for r in submitted]),
        "steady": b.steady.figures() if b.steady else None,
        "floor": floor,
        "burst_over_floor": all_running / 1000 / floor_wall if all_running is not None and floor_wall else None,
        "errors": [f"{r.name}: {r.error}" for r in b.runs if r.error][:5],
    }


def lines(b: Burst) -> list[str]:
    f = figures(b)
    o = b.options
    cpu = f["cpu_ms_per_run"]
    controls = f"{o.controls} x astraeus control" if o.controls > 1 else "astraeus control"
    where = f"apart ({controls}, astraeus scheduler)" if o.services_apart else "in this process"
    per = f"{o.agents_per_process if o.agents_per_process < o.machines else o.machines} per process"
    problems, held = f["problems"], f["invariants"]
    rows = [
        ("machines x GPUs", f"{o.machines} x {o.gpus} = {f['gpus']} GPUs"),
        ("agents", f"{o.machines} in {f['agent_processes']} process(es) ({per})"),
        ("control plane and scheduler", where),
        ("runs: submitted / reached Running", f"{f['submitted']} / {f['running']}"),
        ("run states when read back", ", ".join(f"{k} {v}" for k, v in sorted(f["states"].items()))),
        (
            "first submit -> all Running",
            _seconds(f["all_running_seconds"], f"(when {o.target} runs had reached Running)"),
        ),
        ("first to last submit", _seconds(f["submit_span_seconds"])),
        ("submit call, median / p99 / max (ms)", _triple(f["submit_rpc_ms"])),
        (
            "submit -> Running, median / p99 / max (ms)",
            fmt_latency([ms(r.running_at, r.submitted) for r in _running(b)]),
        ),
        ("  p99 / p50", f"{f['p99_over_p50']:.2f}" if f["p99_over_p50"] is not None else "n/a"),
        ("  submit -> created_at (ms)", fmt_latency([ms(r.created_at, r.submitted) for r in _running(b)])),
        ("  created_at -> Running (ms)", fmt_latency([ms(r.running_at, r.created_at) for r in _running(b)])),
        ("idle submit -> Running, median (ms)", _idle(f)),
        ("history events per run, mean / max", _pair(f["events_per_run"])),
        ("  per run: workflow tasks / activities / signals / SA upserts", _counts(f["per_run_counts"])),
        ("  per waiting run, mean / max", _pair(f["events_per_waiting_run"])),
        ("  machines' workflows, per run", f"{f['machine_workflow_events_per_run']:.1f}"),
        ("workflow task failures+timeouts: runs / machines", f"{problems['runs_wft']} / {problems['machines_wft']}"),
        ("activity retries: runs / machines", f"{problems['runs_retries']} / {problems['machines_retries']}"),
        (
            "activity timeouts+failures: runs / machines",
            f"{problems['runs_activity']} / {problems['machines_activity']}",
        ),
        (
            "invariants: worker processes alive; started twice / GPUs held twice / without their GPU",
            f"{held['workers_alive']}; {held['started_twice']} / {held['gpus_held_twice']} / {held['without_gpu']}",
        ),
        ("  runs unaccounted for / worker processes of no run", f"{held['unaccounted']} / {held['strays']}"),
        ("CPU ms per run: ours / dev server", f"{cpu['ours']:.0f} / {cpu['server']:.0f}"),
        ("  ours: this process / agents", f"{cpu['this']:.0f} / {cpu['agents']:.0f}"),
    ]
    if o.services_apart:
        rows.append(("  ours: control plane + scheduler processes", f"{cpu['services']:.0f}"))
    else:
        count, seconds = b.passes
        rows.append((
            "  scheduling passes: count / mean ms / ms per run",
            f"{count:.0f} / {seconds * 1000 / max(count, 1):.2f} / {seconds * 1000 / max(f['submitted'], 1):.1f}",
        ))  # fmt: skip
    rows += [
        ("  garbage collections in this process / CPU ms / longest ms", b.pauses.text()),
        (
            "CPU ms per worker process in the burst (shim + sleep; fork servers)",
            f"{f['workers_cpu_ms_per_worker']:.0f} ({f['workers_alive']} alive)",
        ),
        ("cores busy during the burst", _cores(b)),
        ("load average (1 min), start / end", f"{b.load[0]:.2f} / {b.load[1]:.2f} (others' work counts)"),
        *b.server.rows("server", f["submitted"]),
    ]
    if f["submitted"] > o.target:
        rows.append(
            ("overload: Running among the first by claim", f"{f['running_among_first_by_claim']} of {o.target}")
        )
    rows += latency_rows("worker state changes", (s for r in _running(b) for s in r.steps))
    rows += latency_rows(
        "history: activities and workflow tasks", (p for r in _running(b) if r.history for p in r.history.phases)
    )
    out = table(rows)
    out += _reason_lines("reasons of the waiting runs now", f["reasons_now"])
    out += _reason_lines("reasons their worker had while Pending (runs)", f["reasons_seen_while_waiting"])
    out += _reason_lines("reasons of the runs that ended", f["reasons_ended"])
    if problems["kinds"]:
        out += ["timeouts, failures and retries by kind:"]
        for kind, n in problems["kinds"].items():
            named = problems["examples"].get(kind)
            out.append(f"{n:5d} x {kind}" + (f", e.g. {', '.join(named)}" if named else ""))
    if held["broken"]:
        out += ["invariants broken:", *held["cases"]]
    out += [f"error: {e}" for e in f["errors"]]
    if b.steady is not None:
        out += ["", *table(b.steady.rows())]
    if b.floor is not None:
        ratio = f["burst_over_floor"]
        ratio_row = ("burst all-Running / floor all-complete", f"{ratio:.2f}" if ratio is not None else "n/a")
        out += ["", *table([*b.floor.rows(), ratio_row])]
    return out


def _invariants(b: Burst) -> dict[str, Any]:
    found = burst_checks.check(b.runs, b.workers, burst_checks.GPUS)
    return {**found.counts(), "cases": burst_checks.lines(found)}


def _running(b: Burst) -> list[Run]:
    return [r for r in b.runs if r.running_at is not None]


def _problems(b: Burst) -> dict[str, Any]:
    runs = [r.history for r in b.runs if r.history]
    kinds: collections.Counter[str] = collections.Counter()
    examples: dict[str, list[str]] = {}  # a few runs of each kind, to read their histories
    for who, histories in (("run", runs), ("machine", b.machine_histories)):
        for h in histories:
            kinds.update(f"{who}: {p}" for p in h.workflow_task_problems + h.activity_problems)
            kinds.update(f"{who}: {name} retried ({why})" for name, why in h.activity_retries)
    for r in b.runs:
        kinds.update(f"run: {name} in flight, retrying ({why})" for name, why in r.pending_retries)
        found = r.history.workflow_task_problems + r.history.activity_problems if r.history else []
        found += [f"{name} retried ({why})" for name, why in r.history.activity_retries] if r.history else []
        found += [f"{name} in flight, retrying ({why})" for name, why in r.pending_retries]
        for kind in dict.fromkeys(found):
            named = examples.setdefault(f"run: {kind}", [])
            if len(named) < EXAMPLES:
                named.append(r.name)
    return {
        "runs_wft": sum(len(h.workflow_task_problems) for h in runs),
        "machines_wft": sum(len(h.workflow_task_problems) for h in b.machine_histories),
        "runs_retries": sum(len(h.activity_retries) for h in runs) + sum(len(r.pending_retries) for r in b.runs),
        "machines_retries": sum(len(h.activity_retries) for h in b.machine_histories),
        "runs_activity": sum(len(h.activity_problems) for h in runs),
        "machines_activity": sum(len(h.activity_problems) for h in b.machine_histories),
        "kinds": dict(kinds.most_common()),
        "examples": examples,
    }


def _reasons(per_run: list[list[str]]) -> list[dict[str, Any]]:
    """Each pattern with how many runs had it and a few exact texts, most common first."""
    counts: collections.Counter[str] = collections.Counter()
    texts: dict[str, list[str]] = {}
    for reasons in per_run:
        for key in dict.fromkeys(pattern(r) for r in reasons):
            counts[key] += 1
        for reason in reasons:
            seen = texts.setdefault(pattern(reason), [])
            if reason not in seen and len(seen) < EXAMPLES:
                seen.append(reason)
    return [{"pattern": k, "runs": n, "examples": texts[k]} for k, n in counts.most_common()]


def _reason_lines(title: str, reasons: list[dict[str, Any]]) -> list[str]:
    if not reasons:
        return []
    out = [f"{title}:"]
    for item in reasons:
        out.append(f"{item['runs']:5d} x {item['pattern']}")
        out += [f"          e.g. {text}" for text in item["examples"] if text != item["pattern"]]
    return out


def _events(runs: list[Run]) -> dict[str, float | None]:
    values = [r.history.events for r in runs if r.history]
    return {"mean": _mean(values), "max": max(values, default=None)}


def _mean(values: list[int] | list[float]) -> float | None:
    return statistics.mean(values) if values else None


def _seconds(value: float | None, note: str = "") -> str:
    return f"{value:.2f} s {note}".rstrip() if value is not None else f"n/a {note}".rstrip()


def _triple(value: dict[str, float | None]) -> str:
    if value["p50"] is None:
        return "n/a"
    return f"{value['p50']:7.0f} / {value['p99']:7.0f} / {value['max']:7.0f}"


def _pair(value: dict[str, float | None]) -> str:
    return f"{value['mean']:.1f} / {value['max']}" if value["mean"] is not None else "n/a"


def _counts(value: dict[str, float | None]) -> str:
    return " / ".join(f"{v:.1f}" if v is not None else "n/a" for v in value.values())


def _idle(f: dict[str, Any]) -> str:
    idle = f["idle_submit_to_running_ms"]
    if idle["p50"] is None:
        return "n/a"
    return f"{idle['p50']:.0f}   (each: {', '.join(f'{v:.0f}' for v in idle['each'])})"


def _cores(b: Burst) -> str:
    """Cores kept busy by our processes and the server from just before the first submit to all Running seen."""
    if b.window <= 0:
        return "n/a"
    return f"{sum(b.cpu.values()) / b.window:.2f} of {os.cpu_count()} (this process, agents, services, server)"


def pair_figures(b: Burst) -> dict[str, Any]:
    """A pair's headline: its burst's all-Running, its floor's all-complete, their ratio, and the load at its start."""
    f = figures(b)
    floor = f["floor"]
    return {
        "all_running_seconds": f["all_running_seconds"],
        "floor_seconds": floor["wall_seconds"] if floor else None,
        "burst_over_floor": f["burst_over_floor"],
        "load_average": f["load_average"],
    }


def pair_row(i: int, p: dict[str, Any]) -> tuple[str, str]:
    """Pair `i`'s headline (`pair_figures`) as a row: its label and its figures."""
    burst, floor, ratio = p["all_running_seconds"], p["floor_seconds"], p["burst_over_floor"]
    return (
        f"pair {i}: all Running / floor / ratio (load at start)",
        f"{_or_na(burst, '.2f')} s / {_or_na(floor, '.2f')} s / {_or_na(ratio, '.2f')}"
        f" ({p['load_average']['start']:.2f})",
    )


def pair_lines(bursts: list[Burst]) -> list[str]:
    """Each pair (a burst, then its floor) on a line, and the median ratio: on a shared machine one pair's ratio
    drifts with the others' work, their median less."""
    pairs = [pair_figures(b) for b in bursts]
    rows = [pair_row(i, p) for i, p in enumerate(pairs, 1)]
    ratios = [p["burst_over_floor"] for p in pairs if p["burst_over_floor"] is not None]
    median = f"{statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})" if ratios else "n/a"
    return ["", *table([*rows, (f"median ratio of {len(pairs)} pairs", median)])]


def _or_na(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)
