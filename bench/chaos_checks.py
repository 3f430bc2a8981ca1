"""The fault-injection suite's checks, pure: the workers' journal read into intervals, and what it and the runs'
read-back say: runs lost, workers started twice, GPUs held by two workers at once, reasons that are not true, and
what each fault cost. `bench.chaos` gathers the inputs; nothing here does I/O."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from workflows.domain.reasons import R, all_templates

# Every line a worker writes: `<kind> <namespace> <run> <task> <attempt> <node> <gpus> <epoch seconds> <pid>`, then
# for `end` (it slept and exits 0) and `term` (SIGTERM: it was stopped) its exit code. `gpus` is its
# CUDA_VISIBLE_DEVICES, `-` when empty.
WORKER_SCRIPT = (
    'line() { echo "$1 $ASTRAEUS_NAMESPACE $ASTRAEUS_RUN $ASTRAEUS_TASK $ASTRAEUS_ATTEMPT $ASTRAEUS_NODE '
    '${CUDA_VISIBLE_DEVICES:--} $(date +%s.%N) $$ $2" >> "$CHAOS_JOURNAL"; }; '
    "trap 'line term 143; exit 143' TERM; line start; sleep SECONDS; line end 0"
)


def worker_command(seconds: float) -> list[str]:
    """A worker that records its start and its end in the journal (`$CHAOS_JOURNAL`) and sleeps in between."""
    return ["sh", "-c", WORKER_SCRIPT.replace("SECONDS", f"{seconds:g}")]


ENDED = {"Completed", "Failed", "Cancelled", "Terminated"}
CODES = {template.code for template in all_templates()}
# What a run that waits for room may say (the run's own reason, or its worker's).
WAITING_CODES = {
    R.WaitingForWorkersToStart.code,
    R.WaitingForWorkersToBeCreated.code,
    R.RunCreated.code,
    R.NoMachineFits.code,
    R.NextToRunStartsBy.code,
    R.NextToRunWaits.code,
    R.QueuedBehindHigherPriority.code,
    R.QueuedBehindStartsBy.code,
    R.QueuedBehind.code,
    R.Placed.code,
    R.PickedUp.code,
    R.RestartedByPolicy.code,
}


@dataclass
class Interval:
    """One worker process, from its journal lines: when it started, and when it ended (None: never seen ending)."""

    run: str  # namespace/name
    task: str
    attempt: int
    node: str
    gpus: tuple[int, ...]
    pid: int
    start: float
    end: float | None = None
    code: int | None = None  # 0: it slept and ended; 143: stopped; None: no end line

    @property
    def slug(self) -> str:
        namespace, name = self.run.split("/", 1)
        return f"{namespace}.{name}.{self.task}.{self.attempt}"

    def overlaps(self, other: Interval) -> bool:
        return self.start < (other.end if other.end is not None else math.inf) and other.start < (
            self.end if self.end is not None else math.inf
        )


def read_journal(text: str, exit_times: dict[tuple[str, str], float] | None = None) -> list[Interval]:
    """Intervals by start line, each closed by its own process's `end` or `term` line; one without (killed) ends
    when its attempt's `exit` file was written (`exit_times` by (node, slug)), else is open."""
    open_: dict[tuple[str, str, str, int, int], Interval] = {}
    intervals: list[Interval] = []
    for raw in text.splitlines():
        fields = raw.split()
        if len(fields) < 9:
            continue  # a line cut by a kill: never a start that ran (its start line came first)
        kind, namespace, run, task, attempt, node, gpus, at, pid = fields[:9]
        key = (f"{namespace}/{run}", task, node, int(attempt), int(pid))
        if kind == "start":
            indices = tuple(int(i) for i in gpus.split(",")) if gpus != "-" else ()
            interval = Interval(f"{namespace}/{run}", task, int(attempt), node, indices, int(pid), float(at))
            open_[key] = interval
            intervals.append(interval)
        elif key in open_:
            interval = open_.pop(key)
            interval.end = float(at)
            interval.code = int(fields[9]) if len(fields) > 9 else None
    for interval in open_.values():
        interval.end = (exit_times or {}).get((interval.node, interval.slug))
    return sorted(intervals, key=lambda i: i.start)


# ---- workers started twice, GPUs held twice ---------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One thing a check found, and when it happened (the later start), to tell which fault it followed."""

    text: str
    at: float
    node: str | None = None  # the machine of the first of the two: an agent's fault there is the likely cause

    def __str__(self) -> str:
        return self.text


@dataclass
class StartedTwice:
    """Each kind of second start, as `run/task: what` cases."""

    same_attempt: list[Case] = field(default_factory=list)  # one attempt's process started more than once
    overlapping: list[Case] = field(default_factory=list)  # two attempts of one worker alive at once
    after_completing: list[Case] = field(default_factory=list)  # started again after an attempt ended with 0
    # Started again after an attempt ended with 0 while its machine's agent was dead, before a new agent was there to
    # read that end: nothing alive saw it, and the spec restarts a worker lost with its machine. Shown, not failed.
    unseen_end: list[Case] = field(default_factory=list)

    @property
    def cases(self) -> list[Case]:
        return self.same_attempt + self.overlapping + self.after_completing

    @property
    def workers(self) -> int:
        """Workers (run/task) with any of them."""
        return len({case.text.split(":", 1)[0] for case in self.cases})


def started_twice(intervals: Iterable[Interval], faults: Iterable[Fault] = ()) -> StartedTwice:
    """Every second start of a worker; one after an end that no agent was alive to see is kept apart (`faults`:
    the agents killed, and when their machine was theirs again)."""
    found = StartedTwice()
    agents_dead = [f for f in faults if f.node is not None and f.name not in AGENT_ALIVE]
    by_worker: dict[tuple[str, str], list[Interval]] = {}
    for interval in intervals:
        by_worker.setdefault((interval.run, interval.task), []).append(interval)
    for (run, task), starts in sorted(by_worker.items()):
        name = f"{run}/{task}"
        attempts = [i.attempt for i in starts]
        for attempt in sorted({a for a in attempts if attempts.count(a) > 1}):
            again = [i for i in starts if i.attempt == attempt]
            nodes = ", ".join(i.node for i in again)
            text = f"{name}: attempt {attempt} started {len(again)} times ({nodes})"
            found.same_attempt.append(Case(text, again[1].start, again[0].node))
        for a, b in itertools.combinations(starts, 2):  # sorted by start: b started after a
            if a.attempt != b.attempt and a.overlaps(b):
                text = f"{name}: attempts {a.attempt} on {a.node} and {b.attempt} on {b.node} ran at once"
                found.overlapping.append(Case(text, b.start, a.node))
        for a, b in itertools.combinations(starts, 2):
            if a.code == 0 and a.end is not None and b.start >= a.end:
                text = (
                    f"{name}: attempt {b.attempt} on {b.node} started after attempt {a.attempt} on {a.node} "
                    "had completed (exit 0)"
                )
                dead = next((f for f in agents_dead if f.node == a.node and _unseen(f, a.end, b.start)), None)
                if dead is not None:
                    found.unseen_end.append(Case(f"{text} while its agent was dead ({dead.name})", b.start, a.node))
                else:
                    found.after_completing.append(Case(text, b.start, a.node))
                break
    return found


def _unseen(fault: Fault, ended: float, again: float) -> bool:
    """Whether an end at `ended` on the fault's machine came while its agent was dead, and the start `again` came
    before a new agent held the machine (Ready again; else restarted) and could read it."""
    back = fault.ready_again if fault.ready_again is not None else fault.restarted
    return fault.killed <= ended and (back is None or (ended <= back and again <= back))


def gpus_held_twice(intervals: Iterable[Interval]) -> list[Case]:
    """`node GPU i: a and b` for every two workers that held one GPU of one machine at overlapping times."""
    by_gpu: dict[tuple[str, int], list[Interval]] = {}
    for interval in intervals:
        for index in interval.gpus:
            by_gpu.setdefault((interval.node, index), []).append(interval)
    found = []
    for (node, index), holders in sorted(by_gpu.items()):
        for a, b in itertools.combinations(holders, 2):
            if a.overlaps(b):
                found.append(Case(f"{node} GPU {index}: {a.slug} and {b.slug}", max(a.start, b.start), node))
    return found


def without_gpu(intervals: Iterable[Interval], gpus: int) -> list[str]:
    """Workers that did not get exactly the GPUs they asked for."""
    return [f"{i.slug} on {i.node}: GPUs {list(i.gpus)}" for i in intervals if len(i.gpus) != gpus]


# ---- the runs ---------------------------------------------------------------------------------------------------


@dataclass
class RunRead:
    """A submitted run as read back at the end."""

    run: str  # namespace/name
    submitted: bool = True  # its submit call succeeded
    error: str | None = None  # why it could not be read back
    closed: bool = False  # its workflow is closed
    state: str = ""
    code: str = ""
    reason: str = ""
    worker_state: str = ""
    worker_code: str = ""
    worker_reason: str = ""
    closed_at: float | None = None  # when its workflow closed (epoch seconds)
    history: list[tuple[float, str, str]] = field(default_factory=list)  # (at, code, reason): the run's, its workers'


@dataclass
class Verdict:
    run: str
    kind: str  # ended | waiting | lost | untrue | unsettled
    why: str


def judge(read: RunRead, intervals: list[Interval]) -> Verdict:
    """Whether the run ended or waits with a true reason; lost when it is gone or its work vanished."""
    if read.error is not None:
        return Verdict(read.run, "lost", f"not read back: {read.error}")
    if read.code not in CODES:
        return Verdict(read.run, "untrue", f"{read.state}: reason {read.reason!r} has no code of the vocabulary")
    completed = [i for i in intervals if i.code == 0]
    alive = [i for i in intervals if i.end is None]
    if read.state == "Completed":
        if read.code != R.AllWorkersCompleted.code:
            return Verdict(read.run, "untrue", f"Completed with {read.reason!r}")
        if not completed:
            return Verdict(read.run, "lost", "Completed, but its worker never ran to its end (journal)")
        return Verdict(read.run, "ended", read.reason)
    if read.state in ENDED:
        if read.state == "Failed" and completed and all(i.code == 0 for i in intervals):
            return Verdict(read.run, "untrue", f"Failed ({read.reason}) though every attempt of its worker exited 0")
        if not read.closed:
            return Verdict(read.run, "unsettled", f"{read.state} but its workflow is still open: {read.reason}")
        return Verdict(read.run, "ended", read.reason)
    if read.state == "Pending" and not alive and read.worker_code in WAITING_CODES | {""}:
        return Verdict(read.run, "waiting", read.worker_reason or read.reason)
    running = f"{len(alive)} of its worker processes alive" if alive else "no worker process alive (journal)"
    return Verdict(read.run, "unsettled", f"{read.state} ({read.reason}; worker: {read.worker_reason}); {running}")


# ---- what each fault cost ---------------------------------------------------------------------------------------


@dataclass
class Fault:
    """One kill -9 and its restart, in epoch seconds (the journal's clock)."""

    name: str
    process: str  # what was killed: control, scheduler, agents-<i>, temporal
    node: str | None = None  # the machine of an agent
    killed: float = 0.0
    restarted: float | None = None
    ready_again: float | None = None  # the machine Ready again (agents), when seen
    note: str = ""  # what went wrong with the restart, if anything
    lease_expired: bool = False  # the machine was not Ready at some time between the kill and its new agent
    lease_ttl: float = 0.0  # the machines' lease (node_lease_ttl_seconds)
    waiting_at_kill: int = 0  # runs whose worker had not started yet: the fault hit mid-burst when > 0
    alive_at_kill: int = 0  # worker processes alive (on its machine, for an agent)
    extra: dict[str, Any] = field(default_factory=dict)  # what a fault of bench.chaos_faults measured as it ran


# The longer faults (bench.chaos_faults) need workers alive when they hit, not runs waiting: a partition or a full
# disk shows what it does only where a worker was running (and, for a partition, where another machine has room to
# start it again); the gang's needs the cluster idle, its gang placed whole at once.
LONGER_FAULTS = ("partition", "temporal-away", "two-schedulers", "full-disk")
AFTER_THE_BURST = ("gang-barrier-kill",)
# Faults on a machine whose agent stayed alive (cut off, or its disk full): an end there was not unseen for want of an
# agent, and a re-run after it counts.
AGENT_ALIVE = ("partition", "full-disk")


def not_as_named(fault: Fault) -> str | None:
    """Why the fault was not the one its name says, if it was not: it must hit mid-burst, and an agent's lease must
    outlive (or not) its restart."""
    if fault.name in LONGER_FAULTS:
        return None if fault.alive_at_kill else f"{fault.name}: no worker was alive when it hit"
    if fault.waiting_at_kill == 0 and fault.name not in AFTER_THE_BURST:
        return f"{fault.name}: no run was still waiting when it hit (after the burst)"
    back = fault.ready_again - fault.killed if fault.ready_again is not None else None
    if fault.name == "agent-within-lease" and back is not None and back > fault.lease_ttl:
        return f"{fault.name}: the new agent of {fault.node} registered {back:.1f} s after the kill, past the lease"
    if fault.name == "agent-after-lease" and not fault.lease_expired:
        return f"{fault.name}: {fault.node} was never seen not Ready"
    return None


def blamed(case: Case, faults: list[Fault]) -> int | None:
    """The index of the fault a case most likely followed: the last agent fault on its machine before it, else the
    last fault before it (None: before any fault)."""
    before = [i for i, f in enumerate(faults) if f.killed <= case.at]
    on_its_machine = [i for i in before if case.node is not None and faults[i].node == case.node]
    chosen = on_its_machine or before
    return max(chosen, key=lambda i: faults[i].killed) if chosen else None


def lost_within_lease(fault: Fault) -> str | None:
    """A machine that went Down although its new agent registered within the lease's TTL of the kill: the lease
    did not last as long as it says."""
    back = fault.ready_again - fault.killed if fault.ready_again is not None else None
    if fault.name != "agent-within-lease" or not fault.lease_expired or back is None or back > fault.lease_ttl:
        return None
    return (
        f"{fault.node} went Down though its new agent registered {back:.1f} s after the kill "
        f"(lease {fault.lease_ttl:g} s)"
    )


def resumed_after(fault: Fault, intervals: list[Interval]) -> float | None:
    """Seconds from the kill to the first worker started after the restart (on its machine, for an agent)."""
    if fault.restarted is None:
        return None
    after = [i.start for i in intervals if i.start > fault.restarted and (fault.node is None or i.node == fault.node)]
    return min(after) - fault.killed if after else None


def alive_at(intervals: Iterable[Interval], at: float, node: str | None = None) -> int:
    return sum(
        1 for i in intervals if i.start <= at and (i.end is None or i.end > at) and (node is None or i.node == node)
    )


def longest_gap(intervals: list[Interval], since: float, until: float) -> float:
    """The longest time without a worker starting anywhere, in [since, until]."""
    starts = [since, *sorted(i.start for i in intervals if since < i.start < until), until]
    return max(b - a for a, b in itertools.pairwise(starts))
