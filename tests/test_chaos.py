"""The fault-injection suite: its pure checks on made-up journals, and a short run of `bench.chaos` (every fault,
a few dozen runs on 2 machines) that must find 0 runs lost, 0 workers started twice, 0 GPUs held twice."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.chaos_checks import (
    Fault,
    RunRead,
    gpus_held_twice,
    judge,
    lost_within_lease,
    not_as_named,
    read_journal,
    started_twice,
)
from bench.chaos_report import Outcome, outcome_lines

ROOT = Path(__file__).parent.parent
COMPLETED, WAITING = "AllWorkersCompleted", "WaitingForWorkersToStart"


def line(kind: str, run: str, attempt: int, node: str, gpus: str, at: float, pid: int, code: str = "") -> str:
    return f"{kind} chaos {run} worker-0 {attempt} {node} {gpus} {at} {pid} {code}".rstrip()


def test_a_journal_pairs_each_start_with_its_own_processes_end() -> None:
    text = "\n".join(
        [
            line("start", "a", 0, "m-000", "0", 1.0, 10),
            line("start", "b", 0, "m-000", "1", 1.5, 11),
            line("term", "b", 0, "m-000", "1", 2.0, 11, "143"),
            line("end", "a", 0, "m-000", "0", 3.0, 10, "0"),
            line("start", "c", 0, "m-001", "0", 4.0, 12),
            "end chaos c worker-0 0 m-0",  # cut short by a kill
        ]
    )
    a, b, c = read_journal(text, {("m-001", "chaos.c.worker-0.0"): 9.0})
    assert (a.end, a.code, b.end, b.code, c.end, c.code) == (3.0, 0, 2.0, 143, 9.0, None)


@pytest.mark.parametrize(
    ("lines", "same", "overlapping", "after"),
    [
        ([line("start", "a", 0, "m-0", "0", 1, 1), line("end", "a", 0, "m-0", "0", 2, 1, "0")], 0, 0, 0),
        ([line("start", "a", 0, "m-0", "0", 1, 1), line("start", "a", 0, "m-1", "0", 2, 2)], 1, 0, 0),
        ([line("start", "a", 0, "m-0", "0", 1, 1), line("start", "a", 1, "m-1", "0", 2, 2)], 0, 1, 0),
        (
            [
                line("start", "a", 0, "m-0", "0", 1, 1),
                line("end", "a", 0, "m-0", "0", 2, 1, "0"),
                line("start", "a", 1, "m-1", "0", 3, 2),
                line("end", "a", 1, "m-1", "0", 4, 2, "0"),
            ],
            0,
            0,
            1,
        ),
        (
            [
                line("start", "a", 0, "m-0", "0", 1, 1),
                line("term", "a", 0, "m-0", "0", 2, 1, "143"),
                line("start", "a", 1, "m-1", "0", 3, 2),
            ],
            0,
            0,
            0,
        ),
    ],
    ids=[
        "one start is fine",
        "one attempt started on two machines",
        "a second attempt while the first still runs",
        "a worker run again after it completed",
        "a restart after a stop is fine",
    ],
)
def test_workers_started_twice_are_found(lines: list[str], same: int, overlapping: int, after: int) -> None:
    found = started_twice(read_journal("\n".join(lines)))
    assert (len(found.same_attempt), len(found.overlapping), len(found.after_completing)) == (same, overlapping, after)


@pytest.mark.parametrize(
    ("again", "ready_again", "unseen", "after"),
    [(6.0, 8.0, 1, 0), (9.0, 8.0, 0, 1)],
    ids=["re-run before a new agent was there to read the end", "re-run after the new agent held the machine"],
)
def test_a_rerun_after_an_end_no_agent_was_alive_to_see_is_kept_apart(
    again: float, ready_again: float, unseen: int, after: int
) -> None:
    # m-0's agent is killed at 3; its worker exits 0 at 4, unseen; the run restarts it on m-1 at `again`
    text = "\n".join(
        [
            line("start", "a", 0, "m-0", "0", 1, 1),
            line("end", "a", 0, "m-0", "0", 4, 1, "0"),
            line("start", "a", 1, "m-1", "0", again, 2),
        ]
    )
    fault = Fault("agent-after-lease", "agents-0", "m-0", killed=3.0, restarted=7.0, ready_again=ready_again)
    found = started_twice(read_journal(text), [fault])
    assert (len(found.unseen_end), len(found.after_completing)) == (unseen, after)
    assert found.cases == found.after_completing  # only those fail the check


def test_one_gpu_held_by_two_workers_at_once_is_found_and_one_after_the_other_is_not() -> None:
    text = "\n".join(
        [
            line("start", "a", 0, "m-0", "3", 1, 1),
            line("end", "a", 0, "m-0", "3", 5, 1, "0"),
            line("start", "b", 0, "m-0", "3", 4, 2),  # GPU 3 while a holds it
            line("end", "b", 0, "m-0", "3", 6, 2, "0"),
            line("start", "c", 0, "m-0", "3", 6.5, 3),  # after both
            line("start", "d", 0, "m-1", "3", 4, 4),  # another machine
        ]
    )
    assert [str(c) for c in gpus_held_twice(read_journal(text))] == [
        "m-0 GPU 3: chaos.a.worker-0.0 and chaos.b.worker-0.0"
    ]


@pytest.mark.parametrize(
    ("read", "journal", "kind"),
    [
        (RunRead("chaos/a", closed=True, state="Completed", code=COMPLETED), "end", "ended"),
        (RunRead("chaos/a", closed=True, state="Completed", code=COMPLETED), "", "lost"),
        (RunRead("chaos/a", error="no run named a"), "", "lost"),
        (RunRead("chaos/a", state="Pending", code=WAITING, worker_code="QueuedBehind"), "", "waiting"),
        (RunRead("chaos/a", state="Running", code="WorkersRunning"), "end", "unsettled"),
        (RunRead("chaos/a", closed=True, state="Failed", code="Made up"), "", "untrue"),
        (RunRead("chaos/a", closed=True, state="Failed", code="WorkerLost"), "end", "untrue"),
        (RunRead("chaos/a", closed=True, state="Failed", code="WorkerLost"), "", "ended"),
    ],
    ids=[
        "completed after its worker ended",
        "completed though its worker never ended",
        "gone",
        "waiting in the queue",
        "running with no worker alive",
        "a reason outside the vocabulary",
        "failed though its worker exited 0",
        "failed, its worker lost",
    ],
)
def test_each_run_is_judged_by_its_reason_and_the_journal(read: RunRead, journal: str, kind: str) -> None:
    lines = [line("start", "a", 0, "m-0", "0", 1, 1)] if journal else []
    lines += [line("end", "a", 0, "m-0", "0", 2, 1, "0")] if journal == "end" else []
    assert judge(read, read_journal("\n".join(lines))).kind == kind


@pytest.mark.parametrize(
    ("ready_again", "expired", "found"),
    [(3, True, True), (3, False, False), (12, True, False)],
    ids=["Down though back within the lease", "kept its lease", "back after the lease: not the lease's fault"],
)
def test_a_machine_down_though_its_agent_was_back_within_the_lease_is_found(
    ready_again: float, expired: bool, found: bool
) -> None:
    fault = Fault("agent-within-lease", "agents-0", "m-000", 0, ready_again=ready_again, lease_expired=expired)
    fault.lease_ttl = 10
    assert (lost_within_lease(fault) is not None) == found


@pytest.mark.parametrize(
    ("fault", "named"),
    [
        (Fault("control", "control", waiting_at_kill=3), True),
        (Fault("control", "control", waiting_at_kill=0), False),
        (Fault("agent-within-lease", "agents-0", "m-000", 0, waiting_at_kill=3, ready_again=12, lease_ttl=10), False),
        (Fault("agent-within-lease", "agents-0", "m-000", 0, waiting_at_kill=3, ready_again=3, lease_ttl=10), True),
        (Fault("agent-after-lease", "agents-1", "m-001", waiting_at_kill=3, lease_expired=False), False),
        (Fault("agent-after-lease", "agents-1", "m-001", waiting_at_kill=3, lease_expired=True), True),
    ],
    ids=[
        "mid-burst",
        "after the burst",
        "an agent back only after its lease",
        "an agent back within its lease",
        "an agent back after its lease that never lost it",
        "an agent back after its lease expired",
    ],
)
def test_a_fault_counts_only_as_what_it_is_named(fault: Fault, named: bool) -> None:
    assert (not_as_named(fault) is None) == named


def run_chaos(tmp_path: Path, args: list[str], limit: float = 420) -> tuple[dict[str, Any], str, int]:
    """`bench.chaos` with `args`: its figures (JSON), its output and its exit status."""
    figures_file = tmp_path / "chaos.json"
    # Not subprocess.run(timeout=...): its SIGKILL would leave the cluster's processes behind. SIGTERM makes the
    # suite end every process it started.
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.chaos", *args, "--json", str(figures_file)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
        pytest.fail(f"bench.chaos ran past {limit:g} s:\n" + output.decode(errors="replace"))
    text = output.decode(errors="replace")
    assert figures_file.exists(), text
    return json.loads(figures_file.read_text()), text, process.returncode


def failed_checks(figures: dict[str, Any]) -> dict[str, int]:
    counts = {label: check["count"] for label, check in figures["checks"].items()}
    return {label: count for label, count in counts.items() if count}


@pytest.mark.integration
@pytest.mark.alone  # both cores busy: after the others (Makefile)
def test_every_fault_in_turn_loses_no_run_starts_no_worker_twice_and_holds_no_gpu_twice(tmp_path: Path) -> None:
    """48 runs on 2 machines x 2 GPUs; kill -9 of the control plane, the scheduler, an agent within its lease, an
    agent past its lease, and the Temporal server, in turn. About 80 s on 2 cores."""
    args = ["--runs", "48", "--machines", "2", "--gpus", "2", "--sleep", "2-4", "--lease-ttl", "8", "--timeout", "240"]
    figures, text, status = run_chaos(tmp_path, args)
    assert failed_checks(figures) == {}, text
    assert figures["settled_s"] is not None, text
    assert [f["fault"] for f in figures["faults"]] == [
        "control",
        "scheduler",
        "agent-within-lease",
        "agent-after-lease",
        "temporal",
    ], text
    assert status == 0, text


@pytest.mark.integration
@pytest.mark.alone
def test_an_agent_cut_off_from_temporal_never_leaves_two_live_copies_of_a_worker(tmp_path: Path) -> None:
    """Issue 39: m-002's agent cut off (a proxy that drops its traffic) for 30 s, its lease 8 s: its machine is lost
    at 8 s and its worker may start elsewhere only after its fence (4 leases); the agent back at 30 s stops its copy.
    The workers' own journal judges: no moment with two live copies, no worker started twice, no run Failed while its
    worker ran. Before the fence its run started it elsewhere 10 s after the loss while it still ran there (on 2
    cores it then ran twice: once to its end on the cut-off machine, once again). About 50 s."""
    args = ["--runs", "5", "--machines", "3", "--gpus", "2", "--sleep", "10-50", "--fault-after", "5"]
    args += ["--lease-ttl", "8", "--faults", "partition", "--partition-seconds", "30", "--timeout", "240"]
    figures, text, status = run_chaos(tmp_path, args)
    assert failed_checks(figures) == {}, text
    assert [f["fault"] for f in figures["faults"]] == ["partition"], text
    assert "partition: moments with two live copies of a worker" in figures["checks"], text
    assert status == 0, text


@pytest.mark.integration
@pytest.mark.alone
def test_temporal_away_longer_than_a_lease_stops_no_worker_and_loses_no_exit(tmp_path: Path) -> None:
    """Issue 39: the Temporal server killed and started again on its database 25 s later, leases of 8 s: no machine is
    lost (each lease's expiry comes late, and its agent registers again in the probation), no worker stopped or run
    again. The workers (10 s each) that exit while Temporal is away are reported once it is back: their watches send
    no heartbeat (protocol 7), so a watch's answer sent meanwhile reached no one, and the runs attach their watches
    again when the machine's lease is taken again. Before that, those runs stayed Running for good. About 60 s."""
    args = ["--runs", "8", "--machines", "2", "--gpus", "2", "--sleep", "10-10"]
    args += ["--lease-ttl", "8", "--faults", "temporal-away", "--away-seconds", "25", "--timeout", "240"]
    figures, text, status = run_chaos(tmp_path, args)
    assert failed_checks(figures) == {}, text
    assert [f["fault"] for f in figures["faults"]] == ["temporal-away"], text
    assert status == 0, text


def test_the_report_fails_a_rerun_and_blames_the_fault_on_its_first_attempts_machine() -> None:
    journal = read_journal(
        "\n".join(
            [
                line("start", "a", 0, "m-001", "0", 10, 1),
                line("end", "a", 0, "m-001", "0", 12, 1, "0"),
                line("start", "a", 1, "m-000", "0", 30, 2),
                line("end", "a", 1, "m-000", "0", 32, 2, "0"),
            ]
        )
    )
    faults = [
        Fault("control", "control", killed=5, restarted=6, waiting_at_kill=1),
        Fault("agent-after-lease", "agents-1", "m-001", killed=11, restarted=25, waiting_at_kill=1, lease_expired=True),
        Fault("temporal", "temporal", killed=27, restarted=28, waiting_at_kill=1),  # the re-run comes after this one
    ]
    read = RunRead("chaos/a", closed=True, state="Completed", code=COMPLETED, reason="All workers completed")
    outcome = Outcome({"machines": 2, "gpus": 2}, 0.0, 40.0, None, [], faults, [read], journal, 1, [])
    lines, figures, failures = outcome_lines(outcome)
    assert failures == ["1 workers started twice"], lines
    assert [(f["fault"], f["started_twice_after"]) for f in figures["faults"]] == [
        ("control", 0),
        ("agent-after-lease", 1),  # the first attempt's machine
        ("temporal", 0),
    ]
    # From the kill: the first start after the restart anywhere; for an agent, on its own machine (none here).
    assert [f["resumed_after_s"] for f in figures["faults"]] == [5.0, None, 3.0]
