"""The judge of the chaos suite's longer faults (issue 39), pure: what the workers' journal (written outside
Astraeus) and the runs' read-back say about a partition of one agent, Temporal away longer than a lease, two
schedulers at once, a kill at a gang's barrier, and a full disk. Each fault gets its checks (each a list of cases
that must be empty) and one line of figures; `bench.chaos_faults` gathers what they need and does the I/O."""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bench.chaos_checks import Fault, Interval, RunRead, gpus_held_twice

NEW_FAULTS = ("partition", "temporal-away", "two-schedulers", "gang-barrier-kill", "full-disk")
GANG_RUN = "gang-0"  # the gang-barrier-kill fault's run, in the chaos namespace
TOGETHER_SECONDS = 2.0  # a gang's members that start (or end) within this of each other start (end) together


@dataclass(frozen=True)
class Moment:
    """A time during which `copies` processes of one worker (run/task) were alive at once."""

    worker: str
    start: float
    end: float
    copies: int
    where: tuple[str, ...]  # attempt@machine of each process alive in it

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.worker}: {self.copies} copies for {self.seconds:.1f} s ({', '.join(self.where)})"


def _end(interval: Interval, until: float) -> float:
    """An interval without an end (still alive when read) ends at `until`, the end of what was observed."""
    return interval.end if interval.end is not None else max(until, interval.start)


def two_copies(intervals: Iterable[Interval], until: float) -> list[Moment]:
    """Every maximal time during which two or more processes of one worker (any attempts, any machines) were alive
    at once, by worker, then by start."""
    by_worker: dict[str, list[Interval]] = collections.defaultdict(list)
    for interval in intervals:
        by_worker[f"{interval.run}/{interval.task}"].append(interval)
    moments = []
    for worker, processes in sorted(by_worker.items()):
        edges = sorted([(i.start, 1, i) for i in processes] + [(_end(i, until), -1, i) for i in processes], key=_edge)
        alive: list[Interval] = []
        began, most, seen = 0.0, 0, set[str]()
        for at, step, interval in edges:
            if step > 0:
                alive.append(interval)
                if len(alive) == 2:
                    began, most, seen = at, 2, set()
                if len(alive) >= 2:
                    most = max(most, len(alive))
                    seen |= {f"{i.attempt}@{i.node}" for i in alive}
            else:
                if len(alive) == 2 and at > began:
                    moments.append(Moment(worker, began, at, most, tuple(sorted(seen))))
                alive.remove(interval)
    return moments


def _edge(edge: tuple[float, int, Interval]) -> tuple[float, int]:
    return (edge[0], edge[1])  # an end before a start at the same time: one after the other is no overlap


def copies_summary(moments: list[Moment]) -> str:
    workers = len({m.worker for m in moments})
    longest = max((m.seconds for m in moments), default=0.0)
    return (
        f"{len(moments)} moments ({workers} workers), {sum(m.seconds for m in moments):.1f} s in all, "
        f"longest {longest:.1f} s"
    )


def failed_while_running(runs: Iterable[RunRead], intervals: Iterable[Interval], until: float) -> list[str]:
    """Runs marked Failed (their workflow closed at `closed_at`) while a process of theirs was still alive."""
    by_run: dict[str, list[Interval]] = collections.defaultdict(list)
    for interval in intervals:
        by_run[interval.run].append(interval)
    found = []
    for read in runs:
        if read.state != "Failed" or read.closed_at is None:
            continue
        for interval in by_run[read.run]:
            after = _end(interval, until) - read.closed_at
            if interval.start < read.closed_at and after > 0:
                found.append(
                    f"{read.run}: Failed ({read.reason}) while {interval.slug} on {interval.node} ran {after:.1f} s on"
                )
    return found


def stopped_or_restarted(intervals: list[Interval], at: float, until: float) -> list[str]:
    """Workers alive at `at` (a fault) that were stopped (SIGTERM, or killed: no end line) before `until`, or whose
    worker started again (a new process) after `at` while or after it ran: the fault cost them their work."""
    found = []
    for i in intervals:
        if not (i.start <= at and (i.end is None or i.end > at)):
            continue
        name = f"{i.run}/{i.task}"
        if i.code != 0 and i.end is not None and i.end <= until:
            how = "stopped (SIGTERM)" if i.code == 143 else "killed (no end line)"
            found.append(f"{name}: attempt {i.attempt} on {i.node} {how} {i.end - at:.1f} s after the fault")
            continue
        again = [j for j in intervals if (j.run, j.task) == (i.run, i.task) and j is not i and at < j.start <= until]
        if again:
            j = again[0]
            found.append(f"{name}: attempt {j.attempt} started on {j.node} {j.start - at:.1f} s after the fault")
    return found


def run_again_after_exit(intervals: list[Interval], since: float) -> list[str]:
    """Workers that started again after `since` though one of their processes had exited 0 before that start."""
    found = []
    by_worker: dict[tuple[str, str], list[Interval]] = collections.defaultdict(list)
    for interval in intervals:
        by_worker[(interval.run, interval.task)].append(interval)
    for (run, task), processes in sorted(by_worker.items()):
        done = [i for i in processes if i.code == 0 and i.end is not None]
        for j in processes:
            before = [i for i in done if i.end is not None and i.end <= j.start]
            if j.start > since and before:
                found.append(
                    f"{run}/{task}: attempt {j.attempt} started on {j.node} after attempt {before[0].attempt} on "
                    f"{before[0].node} had exited 0"
                )
                break
    return found


def history_hits(runs: Iterable[RunRead], words: str, since: float, until: float) -> list[str]:
    """Entries of the runs' (and their workers') histories whose reason says `words` (case-insensitive), at a time
    within [since, until]."""
    found = []
    for read in runs:
        for at, _code, reason in read.history:
            if since <= at <= until and words.lower() in reason.lower():
                found.append(f"{read.run}: {reason}")
    return found


def runs_with(hits: list[str]) -> int:
    return len({hit.split(":", 1)[0] for hit in hits})


def gang_alone(intervals: list[Interval], run: str, members: int, until: float) -> tuple[float, list[str]]:
    """Seconds during which some but not all of a gang's `members` were alive (each stretch longer than
    `TOGETHER_SECONDS`: members start and end a moment apart), and when they were: a gang runs whole or not at all."""
    ours = [i for i in intervals if i.run == run]
    edges = sorted([(i.start, 1) for i in ours] + [(_end(i, until), -1) for i in ours])
    alive, last, total, spans = 0, 0.0, 0.0, []
    for at, step in edges:
        if 0 < alive < members and at - last > TOGETHER_SECONDS:
            total += at - last
            spans.append(f"{alive} of {members} members alive for {at - last:.1f} s")
        alive += step
        last = at
    return total, spans


def started_while_lost(intervals: list[Interval], run: str, fault: Fault) -> list[str]:
    """A gang's members started on another machine while the fault's machine was lost: between its agent's kill and
    the start of its new agent (which then registers; a gang that waited for it starts whole)."""
    back = fault.restarted if fault.restarted is not None else float("inf")
    return [
        f"{i.slug} started on {i.node} {i.start - fault.killed:.1f} s after {fault.node}'s agent was killed"
        for i in intervals
        if i.run == run and fault.killed <= i.start < back and i.node != fault.node
    ]


@dataclass
class Judged:
    """One new fault's checks (label, cases: must be empty) and its line of figures."""

    fault: str
    line: str
    checks: list[tuple[str, list[str]]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def judge_fault(
    fault: Fault, runs: list[RunRead], intervals: list[Interval], until: float, next_kill: float | None
) -> Judged | None:
    """The checks and figures of one of the new faults (None for the others). `until`: the end of what was
    observed; `next_kill`: the next fault's, which ends this one's share of the blame."""
    window_end = next_kill if next_kill is not None else until
    during = [i for i in intervals if i.end is None or i.end >= fault.killed]
    moments = [m for m in two_copies(during, until) if m.end > fault.killed and m.start < window_end]
    copies = [str(m) for m in moments]
    name = fault.name
    if name == "partition":
        failed = failed_while_running(runs, intervals, until)
        seconds = fault.extra.get("seconds")
        return Judged(
            name,
            f"{name} of {fault.node} for {seconds} s: two live copies {copies_summary(moments)}; "
            f"runs Failed while their worker ran {len(failed)}",
            [
                (f"{name}: moments with two live copies of a worker", copies),
                (f"{name}: runs Failed while their worker ran", failed),
            ],
            {"two_copies": len(moments), "two_copies_s": sum(m.seconds for m in moments), "failed_running": failed},
        )
    if name == "temporal-away":
        back = fault.restarted or until
        hurt = stopped_or_restarted(intervals, fault.killed, window_end)
        again = run_again_after_exit(intervals, fault.killed)
        return Judged(
            name,
            f"{name} for {back - fault.killed:.1f} s: {fault.alive_at_kill} workers running at the kill, "
            f"{len(hurt)} stopped or restarted, {len(again)} finished workers run again, two live copies "
            f"{copies_summary(moments)}",
            [
                (f"{name}: running workers stopped or restarted", hurt),
                (f"{name}: finished workers run again", again),
                (f"{name}: moments with two live copies of a worker", copies),
            ],
            {"stopped_or_restarted": len(hurt), "run_again": len(again), "two_copies": len(moments)},
        )
    if name == "two-schedulers":
        stuck = history_hits(runs, "no machines are registered", fault.killed, window_end)
        refused = history_hits(runs, "refused", fault.killed, window_end)
        held = [str(c) for c in gpus_held_twice(intervals) if fault.killed <= c.at <= window_end]
        logged = int(fault.extra.get("refused_in_logs", 0))
        return Judged(
            name,
            f"{name} for {fault.extra.get('seconds')} s: {runs_with(stuck)} runs told 'no machines are registered' "
            f"(machines Ready), starts refused {len(refused)} in histories ({runs_with(refused)} runs) and "
            f"{logged} in agents' logs, GPUs double-booked {len(held)}",
            [
                (f"{name}: runs told no machines are registered", stuck),
                (f"{name}: starts refused", refused + [f"{logged} 'refused' lines in the agents' logs"] * bool(logged)),
                (f"{name}: GPUs double-booked (journal)", held),
            ],
            {"no_machines": runs_with(stuck), "refused": len(refused), "refused_logged": logged, "gpus_x2": len(held)},
        )
    if name == "gang-barrier-kill":
        members = int(fault.extra.get("members", 0))
        run = f"chaos/{GANG_RUN}"
        early = started_while_lost(intervals, run, fault)
        alone_s, spans = gang_alone(intervals, run, members, until)
        reason = fault.extra.get("reason", "?")
        return Judged(
            name,
            f"{name} ({members} members, {fault.node}'s agent killed with {fault.extra.get('at_barrier', '?')} at the "
            f"barrier): {len(early)} members started while {fault.node} was lost, gang incomplete {alone_s:.1f} s; "
            f"the run: {reason}",
            [
                (f"{name}: members started while another member's machine was lost", early),
                (f"{name}: gang ran incomplete", spans),
            ],
            {"started_while_lost": len(early), "incomplete_s": alone_s, "reason": reason},
        )
    if name == "full-disk":
        full_end = fault.restarted or until
        exited = [
            i
            for i in intervals
            if i.node == fault.node and i.code == 0 and i.end is not None and fault.killed <= i.end <= full_end
        ]
        again = run_again_after_exit(intervals, fault.killed)
        names = {f"{i.run}/{i.task}" for i in exited}
        reruns = [a for a in again if a.split(":", 1)[0] in names]
        not_found = history_hits(runs, "not found on the node", fault.killed, until)
        return Judged(
            name,
            f"{name} on {fault.node} for {full_end - fault.killed:.1f} s: {len(exited)} workers exited 0 meanwhile, "
            f"{len(reruns)} run again; 'Container not found' {len(not_found)}; the agent logged "
            f"{fault.extra.get('log_lines', '?')} lines meanwhile ({fault.extra.get('log_disk_lines', '?')} about the "
            "disk)",
            [(f"{name}: exits turned into re-runs", reruns)],
            {"exited": len(exited), "reruns": len(reruns), "not_found": len(not_found)} | fault.extra,
        )
    return None
