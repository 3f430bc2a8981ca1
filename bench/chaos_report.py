"""The fault-injection suite's table and verdict, from what `bench.chaos` gathered: each check with its count and
the first few cases, the runs by how they ended or wait, and what each fault cost."""

from __future__ import annotations

import collections
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.burst_report import pattern
from bench.chaos_checks import (
    Case,
    Fault,
    Interval,
    RunRead,
    Verdict,
    blamed,
    gpus_held_twice,
    judge,
    longest_gap,
    lost_within_lease,
    not_as_named,
    resumed_after,
    started_twice,
    without_gpu,
)
from bench.chaos_judge import Judged, judge_fault
from bench.common import table

SHOWN = 5  # cases listed under a check


@dataclass
class Outcome:
    options: dict[str, Any]
    burst_submitted_at: float
    burst_settled_at: float | None
    baseline_seconds: float | None
    submit_errors: list[str]
    faults: list[Fault]
    runs: list[RunRead]
    intervals: list[Interval]
    gpus_per_worker: int
    unjournaled: list[str]  # attempts a machine started (their files) that wrote no start line
    extra_runs: list[RunRead] = field(default_factory=list)  # read back beside the burst's (the gang's run)
    observed_until: float | None = None  # when the runs were read back: an interval still open ends there


def longer_faults(outcome: Outcome) -> list[Judged]:
    """The checks and the line of figures of each longer fault (bench.chaos_judge)."""
    until = outcome.observed_until or max(
        [outcome.burst_settled_at or 0.0, *(i.end or i.start for i in outcome.intervals)]
    )
    judged = []
    for index, fault in enumerate(outcome.faults):
        later = outcome.faults[index + 1].killed if index + 1 < len(outcome.faults) else None
        one = judge_fault(fault, outcome.runs + outcome.extra_runs, outcome.intervals, until, later)
        if one is not None:
            judged.append(one)
    return judged


def verdicts(outcome: Outcome) -> list[Verdict]:
    by_run: dict[str, list[Interval]] = collections.defaultdict(list)
    for interval in outcome.intervals:
        by_run[interval.run].append(interval)
    return [judge(read, by_run[read.run]) for read in outcome.runs]


def left_running(outcome: Outcome) -> list[str]:
    """Worker processes still alive when the burst ended whose run had ended: nothing will ever stop them."""
    ended = {read.run for read in outcome.runs if read.closed}
    return [f"{i.slug} on {i.node}" for i in outcome.intervals if i.end is None and i.run in ended]


def fault_rows(outcome: Outcome, twice: list[Case], held: list[Case]) -> tuple[list[str], list[dict[str, Any]]]:
    """A row per fault; `twice` and `gpus x2` count the workers started twice and the GPUs held twice it is blamed
    for (`blamed`: the last agent fault on the first one's machine before the second start, else the last fault)."""
    header = (
        f"{'fault':<20} {'killed at':>9} {'down':>6} {'resumed':>8} {'gap':>6} {'ready':>6} {'waiting':>7} "
        f"{'alive':>5} {'twice':>5} {'gpus x2':>7}  note"
    )
    lines, figures = [header], []
    after = collections.Counter(blamed(c, outcome.faults) for c in twice)
    held_after = collections.Counter(blamed(c, outcome.faults) for c in held)
    if after[None] or held_after[None]:
        lines.append(
            f"{'before any fault':<20} {'':>9} {'':>6} {'':>8} {'':>6} {'':>6} {'':>7} {'':>5} "
            f"{after[None]:>5} {held_after[None]:>7}"
        )
    for index, fault in enumerate(outcome.faults):
        resumed = resumed_after(fault, outcome.intervals)
        until = fault.killed + resumed if resumed is not None else (outcome.burst_settled_at or fault.killed)
        gap = longest_gap(outcome.intervals, fault.killed, until) if until > fault.killed else 0.0
        down = (fault.restarted - fault.killed) if fault.restarted is not None else None
        killed_at = fault.killed - outcome.burst_submitted_at
        ready = fault.ready_again - fault.killed if fault.ready_again is not None else None
        row = {
            "fault": fault.name,
            "killed_at_s": killed_at,
            "down_s": down,
            "resumed_after_s": resumed,
            "longest_gap_s": gap,
            "ready_again_after_s": ready,
            "waiting_at_kill": fault.waiting_at_kill,
            "alive_at_kill": fault.alive_at_kill,
            "started_twice_after": after[index],
            "gpus_held_twice_after": held_after[index],
            "note": fault.note,
        } | asdict(fault)
        figures.append(row)
        lines.append(
            f"{fault.name:<20} {_s(killed_at):>9} {_s(down):>6} {_s(resumed):>8} {_s(gap):>6} {_s(ready):>6} "
            f"{fault.waiting_at_kill:>7} {fault.alive_at_kill:>5} {after[index]:>5} {held_after[index]:>7}  "
            f"{fault.note}".rstrip()
        )
    return lines, figures


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


def outcome_lines(outcome: Outcome) -> tuple[list[str], dict[str, Any], list[str]]:
    """The lines to print, the same figures as data, and the checks that failed."""
    judged = verdicts(outcome)
    kinds = collections.Counter(v.kind for v in judged)
    twice = started_twice(outcome.intervals, outcome.faults)
    held_twice = gpus_held_twice(outcome.intervals)
    wrong_gpus = without_gpu(outcome.intervals, outcome.gpus_per_worker)
    orphans = left_running(outcome)
    unresumed = [f"{f.name}: {f.note}" for f in outcome.faults if f.note]
    not_named = [why for why in map(not_as_named, outcome.faults) if why is not None]
    short_leases = [why for why in map(lost_within_lease, outcome.faults) if why is not None]
    settled = outcome.burst_settled_at
    took = settled - outcome.burst_submitted_at if settled is not None else None
    checks = [
        ("runs lost", [f"{v.run}: {v.why}" for v in judged if v.kind == "lost"]),
        ("runs with an untrue reason", [f"{v.run}: {v.why}" for v in judged if v.kind == "untrue"]),
        ("runs neither ended nor waiting", [f"{v.run}: {v.why}" for v in judged if v.kind == "unsettled"]),
        ("workers started twice", [str(c) for c in twice.cases]),
        ("GPUs held by two workers at once", [str(c) for c in held_twice]),
        ("workers without exactly their GPU", wrong_gpus),
        ("workers left running after their run ended", orphans),
        ("worker starts missing from the journal", outcome.unjournaled),
        ("faults the cluster did not recover from", unresumed),
        ("machines Down though their agent was back within the lease", short_leases),
        ("faults not as named (after the burst; an agent back within its lease or not)", not_named),
    ]
    longer = longer_faults(outcome)
    checks += [check for one in longer for check in one.checks]
    rows: list[tuple[str, str]] = [
        ("runs submitted (submit errors)", f"{len(outcome.runs)} ({len(outcome.submit_errors)})"),
        ("machines x GPUs", f"{outcome.options['machines']} x {outcome.options['gpus']}"),
        ("worker processes started / journal lines ended", _process_counts(outcome.intervals)),
        ("first submit -> every run ended", _s(took)),
    ]
    if outcome.baseline_seconds is not None:
        cost = f" (the faults cost {took - outcome.baseline_seconds:.1f} s)" if took is not None else ""
        rows.append(("the same burst without faults", _s(outcome.baseline_seconds) + cost))
    rows.append(("runs ended / waiting", f"{kinds['ended']} / {kinds['waiting']}"))
    for label, cases in checks:
        rows.append((label, str(len(cases)) if label != "workers started twice" else _twice(twice, cases)))
    lines = table(rows)
    lines.append("how the runs ended or wait (reason patterns):")
    ends = collections.Counter(f"{r.state}: {pattern(r.reason)}" for r in outcome.runs if r.error is None)
    lines += [f"  {n:4d} x {text}" for text, n in ends.most_common()]
    lines.append(
        "what each fault cost (seconds from the kill; gap: longest time no worker started anywhere; twice, gpus x2: "
        "found after it, an agent's on its machine):"
    )
    fault_lines, fault_figures = fault_rows(outcome, twice.cases, held_twice)
    lines += ["  " + line for line in fault_lines]
    if longer:
        lines.append("the longer faults (journal outside Astraeus; each check must be 0):")
        lines += [f"  {one.line}" for one in longer]
    failures = []
    for label, cases in checks:
        if cases:
            failures.append(f"{len(cases)} {label}")
            lines.append(f"FAILED: {len(cases)} {label}, e.g.:")
            lines += [f"  {case}" for case in cases[:SHOWN]]
    if took is None:
        failures.append("the burst did not settle before the timeout")
        lines.append("FAILED: the burst did not settle before the timeout")
    lines.append("checks: " + ("all passed" if not failures else f"{len(failures)} failed"))
    figures = {
        "runs": len(outcome.runs),
        "submit_errors": outcome.submit_errors,
        "settled_s": took,
        "baseline_s": outcome.baseline_seconds,
        "verdicts": dict(kinds),
        "checks": {label: {"count": len(cases), "cases": cases[:50]} for label, cases in checks},
        "started_twice": {
            "same_attempt": len(twice.same_attempt),
            "overlapping": len(twice.overlapping),
            "after_completing": len(twice.after_completing),
            "unseen_end": [str(c) for c in twice.unseen_end],
        },
        "ends": dict(ends),
        "faults": fault_figures,
        "longer_faults": {one.fault: one.figures for one in longer},
        "failures": failures,
        "options": outcome.options,
    }
    return lines, figures, failures


def _twice(twice: Any, cases: list[str]) -> str:
    return (
        f"{twice.workers} ({len(twice.same_attempt)} attempts started again, {len(twice.overlapping)} attempts at "
        f"once, {len(twice.after_completing)} re-run after completing; {len(twice.unseen_end)} re-run after an end "
        "no agent was alive to see, not counted)"
    )


def _process_counts(intervals: list[Interval]) -> str:
    codes = collections.Counter(
        "ended" if i.code == 0 else "stopped" if i.code == 143 else "no end line" for i in intervals
    )
    still = sum(1 for i in intervals if i.end is None)
    return (
        f"{len(intervals)}: {codes['ended']} ended, {codes['stopped']} stopped (SIGTERM), "
        f"{codes['no end line']} without an end line ({still} still alive)"
    )
