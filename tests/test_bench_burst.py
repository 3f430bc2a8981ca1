"""`bench.burst` keeps working: a tiny burst prints its figures and exits 0, and waiting reasons group by cause."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from bench.burst import Run
from bench.burst_checks import check, lines
from bench.burst_report import pattern
from bench.chaos_checks import Interval
from workflows.domain.reasons import R

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize(
    ("reason", "grouped"),
    [
        ("Queued behind run-0004", "Queued behind <run>"),
        (
            "Next to run (priority 0): waits for running work to end",
            "Next to run (priority n): waits for running work to end",
        ),
        (
            "Queued behind run-0512, which starts by 2025-01-01 13:00 UTC",
            "Queued behind <run>, which starts by <time> UTC",
        ),
        ("No machine fits: 2 of 64 machines ready", "No machine fits: n of n machines ready"),
    ],
    ids=["a run's name", "the priority", "a start time", "counts"],
)
def test_reasons_group_without_names_times_or_numbers(reason: str, grouped: str) -> None:
    assert pattern(reason) == grouped


@pytest.mark.integration
@pytest.mark.alone  # both cores busy: after the others (Makefile)
def test_a_tiny_burst_prints_its_figures_and_exits_0(tmp_path: Path) -> None:
    """6 runs on 2 machines x 2 GPUs: 4 Running, 2 waiting with a reason, a steady state of 2 s, then a floor of 3
    bare workflows; twice, each pair's ratio and their median told."""
    figures_file = tmp_path / "burst.json"
    args = ["--runs", "6", "--machines", "2", "--gpus", "2", "--idle", "1", "--floor-runs", "3", "--pairs", "2"]
    args += ["--steady", "2", "--settle", "0"]
    result = subprocess.run(
        [sys.executable, "-m", "bench.burst", *args, "--json", str(figures_file), "--data-dir", str(tmp_path / "c")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for label in (
        "first submit -> all Running",
        "submit -> Running, median / p99 / max (ms)",
        "idle submit -> Running, median (ms)",
        "history events per run, mean / max",
        "CPU ms per run: ours / dev server",
        "reasons of the waiting runs now:",
        "floor: first start -> all complete",
        "burst all-Running / floor all-complete",
        "server: requests, per run",
        "server: persistence operations, per run",
        "server: visibility store operations, per run",
        "server: persistence time, ms per run",
        "server: time to serve a request, ms",
        "server: the shard's I/O slot: waits per run / mean wait; a workflow's lock held, mean",
        "floor: server: requests, per run",
        "pair 1: all Running / floor / ratio (load at start)",
        "pair 2: all Running / floor / ratio (load at start)",
        "median ratio of 2 pairs",
        "steady: CPU ms per running worker-second, ours + server",
        "steady: server writes (UpdateWorkflowExecution) per second / per machine",
    ):
        assert label in result.stdout, result.stdout
    for pair in (1, 2):  # told as each pair ends, so that a later pair's failure loses none of them
        assert f"pair {pair}: all Running / floor / ratio (load at start): " in result.stderr, result.stderr
    figures = json.loads(figures_file.read_text())
    assert (figures["submitted"], figures["running"]) == (6, 4)
    assert sum(item["runs"] for item in figures["reasons_now"]) == 2
    assert figures["floor"]["completed"] == 3
    assert figures["steady"]["running_workers"] == {"start": 4, "end": 4}
    assert figures["steady"]["activities_in_flight"]["hold_lease"] == 2  # the census: one lease per machine
    # The server's own counters cover the burst's window: every run started there, every bare workflow too.
    assert figures["server"]["requests_per_run"]["StartWorkflowExecution"] >= 1
    assert figures["server"]["persistence_per_run"]["UpdateWorkflowExecution"] > 1
    assert sum(figures["server"]["visibility_per_run"].values()) >= 1  # each start is a visibility record
    assert figures["floor"]["server"]["requests_per_run"]["StartWorkflowExecution"] >= 1
    assert figures["server"]["served_ms_per_request"]["StartWorkflowExecution"] > 0
    assert figures["server"]["slot_waits_per_run"] > 1  # every write waits its turn, if only for no time
    assert [pair["burst_over_floor"] > 0 for pair in figures["pairs"]] == [True, True]
    # Read from the kernel: each Running run's one worker process, on its machine, with a GPU of its own.
    assert "invariants: worker processes alive; started twice / GPUs held twice / without their GPU" in result.stdout
    assert {k: v for k, v in figures["invariants"].items() if k != "cases"} == {
        "workers_alive": 4,
        "started_twice": 0,
        "gpus_held_twice": 0,
        "without_gpu": 0,
        "unaccounted": 0,
        "strays": 0,
        "broken": 0,
    }
    assert sorted(path.name for path in (tmp_path / "c").iterdir()) == ["pair-1", "pair-2"]  # a fresh cluster each


def test_a_local_activity_tried_again_counts_as_a_retry() -> None:
    """Protocol 3's place and release are local activities: their retries show only in their markers."""
    from temporalio.client import WorkflowHistory

    from bench.common import read_history

    history = WorkflowHistory.from_json("job/default/hello", (ROOT / "tests/histories/hello-p3.json").read_text())
    assert read_history(history.events).activity_retries == []
    for event in history.events:
        if event.HasField("marker_recorded_event_attributes"):
            payload = event.marker_recorded_event_attributes.details["data"].payloads[0]
            data = json.loads(payload.data)
            if data["activity_type"] == "place":
                payload.data = json.dumps(data | {"attempt": 3}).encode()
    assert read_history(history.events).activity_retries == [("place (local)", "attempt 3")]


def test_the_phases_name_the_wait_for_a_workers_report_and_for_the_task_that_reads_it() -> None:
    """Where a run's time goes after its first task: the agent's report, then the workflow task that reads it."""
    from temporalio.client import WorkflowHistory

    from bench.common import read_history

    history = WorkflowHistory.from_json("job/default/hello", (ROOT / "tests/histories/hello-p3.json").read_text())
    names = [name for name, _ in read_history(history.events).phases]
    assert "run_task scheduled -> task_running signal" in names
    assert "signal -> workflow task started" in names


def test_the_servers_counters_are_told_between_two_scrapes() -> None:
    """Requests at the frontend only, persistence operations and failures (not the lookups that find nothing), and
    the bucket that holds a write's median and p99."""
    from bench.server_metrics import between, parse

    def scraped(starts: int, writes: list[int], failures: int) -> str:
        buckets = "".join(
            f'persistence_latency_bucket{{operation="UpdateWorkflowExecution",le="{le}"}} {n}\n'
            for le, n in zip(("0.001", "0.01", "1", "+Inf"), writes, strict=True)
        )
        return (
            "# TYPE service_requests counter\n"
            f'service_requests{{operation="StartWorkflowExecution",service_name="frontend"}} {starts}\n'
            f'service_requests{{operation="RecordWorkflowTaskStarted",service_name="history"}} {starts * 3}\n'
            "# TYPE persistence_requests counter\n"
            f'persistence_requests{{operation="UpdateWorkflowExecution",service_name="history"}} {writes[-1]}\n'
            "# TYPE persistence_error_with_type counter\n"
            'persistence_error_with_type{error_type="serviceerror_DeadlineExceeded",'
            f'operation="UpdateWorkflowExecution"}} {failures}\n'
            'persistence_error_with_type{error_type="serviceerror_NotFound",'
            f'operation="GetTaskQueue"}} {failures * 7}\n'
            "# TYPE persistence_latency histogram\n" + buckets
        )

    ops = between(parse(scraped(2, [0, 0, 0, 0], 1)), parse(scraped(12, [10, 60, 99, 100], 4)))
    assert ops.requests == {"StartWorkflowExecution": 10}
    assert ops.persistence == {"UpdateWorkflowExecution": 100}
    assert ops.errors == {"UpdateWorkflowExecution: serviceerror_DeadlineExceeded": 3}
    assert ops.write_ms == {"p50": 10.0, "p99": 1000.0}
    assert ops.figures(10)["requests_per_run"] == {"StartWorkflowExecution": 1.0}


def test_the_servers_times_are_told_per_run_per_request_and_per_wait() -> None:
    """Where the server's time goes between two scrapes: each persistence operation's time (the visibility store's
    named as such), a frontend request's mean time, the waits for the shard's I/O slot and a workflow lock's hold.
    Timers are in seconds; the figures in ms."""
    from bench.server_metrics import between, parse

    def scraped(scale: int) -> str:
        return (
            "# TYPE service_requests counter\n"
            f'service_requests{{operation="SignalWorkflowExecution",service_name="frontend"}} {4 * scale}\n'
            "# TYPE service_latency histogram\n"
            f'service_latency_sum{{operation="SignalWorkflowExecution",service_name="frontend"}} {0.2 * scale}\n'
            f'service_latency_sum{{operation="RecordWorkflowTaskStarted",service_name="history"}} {9 * scale}\n'
            "# TYPE persistence_latency histogram\n"
            f'persistence_latency_sum{{operation="GetWorkflowExecution"}} {0.03 * scale}\n'
            "# TYPE visibility_persistence_latency histogram\n"
            f'visibility_persistence_latency_sum{{operation="UpsertWorkflowExecution"}} {0.05 * scale}\n'
            "# TYPE semaphore_latency histogram\n"
            f'semaphore_latency_sum{{operation="ShardInfo"}} {1.5 * scale}\n'
            f'semaphore_latency_count{{operation="ShardInfo"}} {30 * scale}\n'
            f'semaphore_latency_bucket{{operation="ShardInfo",le="+Inf"}} {30 * scale}\n'
            "# TYPE history_workflow_execution_cache_lock_hold_duration histogram\n"
            'history_workflow_execution_cache_lock_hold_duration_sum{operation="HistoryCacheGetOrCreate"}'
            f" {0.4 * scale}\n"
            'history_workflow_execution_cache_lock_hold_duration_count{operation="HistoryCacheGetOrCreate"}'
            f" {20 * scale}\n"
        )

    figures = between(parse(scraped(1)), parse(scraped(3))).figures(10)
    assert figures["persistence_ms_per_run"] == {
        "visibility UpsertWorkflowExecution": 10.0,
        "GetWorkflowExecution": 6.0,
    }
    assert figures["served_ms_per_request"] == {"SignalWorkflowExecution": 50.0}  # history's own are not the frontend's
    told = (figures["slot_waits_per_run"], figures["slot_wait_ms"], figures["lock_held_ms"])
    assert told == pytest.approx((6.0, 50.0, 20.0))


def test_the_tasks_the_server_recorded_started_later_than_a_sync_match_may_wait_are_counted() -> None:
    """The history's records of a task handed to a worker, and those that took over 1 s (the matching engine's
    deadline for a task handed to a waiting poll): read from the history's latency histogram, by operation."""
    from bench.server_metrics import between, parse

    def histogram(operation: str, service: str, within: dict[str, int]) -> str:
        rows = [
            f'service_latency_bucket{{operation="{operation}",service_name="{service}",le="{le}"}} {n}\n'
            for le, n in within.items()
        ]
        rows.append(f'service_latency_count{{operation="{operation}",service_name="{service}"}} {within["+Inf"]}\n')
        return "".join(rows)

    def scraped(scale: int) -> str:
        return "# TYPE service_latency histogram\n" + "".join(
            [
                histogram(
                    "RecordActivityTaskStarted",
                    "history",
                    {"0.5": 4 * scale, "1": 6 * scale, "2": 9 * scale, "+Inf": 10 * scale},
                ),
                histogram(
                    "RecordWorkflowTaskStarted", "history", {"0.5": 20 * scale, "1": 20 * scale, "+Inf": 20 * scale}
                ),
                histogram("RecordActivityTaskStarted", "matching", {"0.5": 0, "1": 0, "+Inf": 7 * scale}),
            ]
        )

    ops = between(parse(scraped(1)), parse(scraped(3)))
    assert (ops.records, ops.late_records) == (
        {"RecordActivityTaskStarted": 20, "RecordWorkflowTaskStarted": 40},
        {"RecordActivityTaskStarted": 8, "RecordWorkflowTaskStarted": 0},
    )
    assert (
        "server: tasks recorded started: over 1 s / all",
        "RecordActivityTaskStarted 8 / 20, RecordWorkflowTaskStarted 0 / 40",
    ) in ops.rows("server", 10)


def test_the_historys_own_tasks_are_counted_by_type() -> None:
    """An activity's heartbeat timeout fired is a task of the history's timer queue, and a write when the activity
    heartbeated since: the writes a steady state makes besides the heartbeats themselves."""
    from bench.server_metrics import between, parse

    def scraped(timers: int, transfers: int) -> str:
        labels = 'archetype="workflow",namespace="default",service_name="history",task_priority="low"'
        return (
            "# TYPE task_requests counter\n"
            f'task_requests{{{labels},task_type="TimerActiveTaskActivityTimeout"}} {timers}\n'
            f'task_requests{{{labels},task_type="TransferActiveTaskActivity"}} {transfers}\n'
        )

    ops = between(parse(scraped(4, 7)), parse(scraped(34, 7)))
    assert ops.tasks == {"TimerActiveTaskActivityTimeout": 30}


def test_the_servers_log_is_counted_from_where_the_window_began(tmp_path: Path) -> None:
    """A write that failed names its error; what came before the window, and what is not a warning, is not told."""
    from bench.server_metrics import logged

    log = tmp_path / "temporal.log"
    before = 'time=2026-12-01T16:09:44.547 level=WARN msg="network dial error" service=client\n'
    failed = (
        'time=2026-12-01T16:10:20.213 level=ERROR msg="Update workflow execution operation failed." shard-id=1 '
        'wf-id=job/burst/run-0150 store-operation=update-wf-execution error="context canceled"\n'
    )
    dropped = 'time=2026-12-01T16:10:35.036 level=DEBUG msg="Duplicated workflow task" component=matching-engine\n'
    log.write_text(before)
    _, start = logged(log, 0)
    log.write_text(before + failed + failed + dropped)
    found, end = logged(log, start)
    assert found == {"ERROR Update workflow execution operation failed. (context canceled)": 2}
    assert end == log.stat().st_size


def test_the_steady_state_is_told_per_running_worker_second_and_per_second() -> None:
    """What liveness costs: each process's CPU over the running workers times the window, the workers' own processes
    apart; the server's writes per second and per machine, against machines over the lease's renewal interval."""
    import collections

    from bench.server_metrics import ServerOps
    from bench.steady import Steady

    server = ServerOps(
        requests=collections.Counter(
            {"RecordActivityTaskHeartbeat": 60, "RecordActivityTaskHeartbeatById": 2, "SignalWorkflowExecution": 5}
        ),
        persistence=collections.Counter({"UpdateWorkflowExecution": 80, "GetTimerTasks": 10}),
        tasks=collections.Counter({"TimerActiveTaskActivityTimeout": 18}),
    )
    steady = Steady(
        seconds=10.0,
        settle=20.0,
        machines=4,
        running=(100, 99),
        cpu={"this": 0.5, "services": 0.0, "agents": 0.25, "server": 1.0},
        workers_cpu=(0.1, 100),
        server=server,
        load=(1.0, 1.5),
        in_flight=collections.Counter({"run_task": 100, "hold_lease": 4}),
    )

    figures = steady.figures()

    assert figures["cpu_ms_per_worker_second"] == pytest.approx(
        {"this": 0.5, "services": 0.0, "agents": 0.25, "server": 1.0, "ours": 0.75, "ours_and_server": 1.75}
    )
    told = (
        figures["workers_processes_cpu_ms_per_worker_second"],
        figures["writes_per_second"],
        figures["writes_per_machine_per_second"],
        figures["writes_goal_per_second"],  # 4 machines, a renewal every 5 s (a third of the stale grace, 15 s)
        figures["heartbeats_per_second"],
        figures["signals_per_second"],
    )
    assert told == pytest.approx((0.1, 8.0, 2.0, 0.8, 6.2, 0.5))
    assert figures["persistence_per_second"] == {"UpdateWorkflowExecution": 8.0, "GetTimerTasks": 1.0}
    assert figures["history_tasks_per_second"] == {"TimerActiveTaskActivityTimeout": 1.8}
    assert ("steady: running workers, window start / end", "100 / 99") in steady.rows()
    assert ("steady: heartbeats recorded / signals, per second", "6.20 / 0.50") in steady.rows()


def test_each_kind_of_problem_names_a_few_of_its_runs() -> None:
    """So that their histories can be read: the runs a timeout or retry happened in, the first few of each kind."""
    from types import SimpleNamespace
    from typing import cast

    from bench.burst import Burst, Run
    from bench.burst_report import _problems
    from bench.common import HistoryFigures

    timed_out = "workflow task TIMED_OUT (START_TO_CLOSE), after WORKFLOW_EXECUTION_STARTED"
    runs = [Run(name=f"run-{i:04d}", history=HistoryFigures(workflow_task_problems=[timed_out] * 2)) for i in range(5)]
    runs.append(Run(name="run-0005", history=HistoryFigures(), pending_retries=[("run_task", "Heartbeat timeout")]))
    runs.append(Run(name="run-0006", history=HistoryFigures()))
    found = _problems(cast(Burst, SimpleNamespace(runs=runs, machine_histories=[])))
    assert found["kinds"] == {f"run: {timed_out}": 10, "run: run_task in flight, retrying (Heartbeat timeout)": 1}
    assert found["examples"] == {
        f"run: {timed_out}": ["run-0000", "run-0001", "run-0002"],
        "run: run_task in flight, retrying (Heartbeat timeout)": ["run-0005"],
    }


def test_the_servers_profile_names_its_go_functions_and_who_asked_sqlite() -> None:
    """The pip package's `temporal` is stripped; its Go function table names each address of a perf sample (given
    from where the binary is loaded), and the samples inside SQLite are told by the store method that asked."""
    from bench.server_profile import GoSymbols, call_chains, report
    from workers.devserver import temporal_binary

    symbols = GoSymbols(Path(temporal_binary()).resolve())
    upsert = "go.temporal.io/server/common/persistence/visibility/store/sql.(*VisibilityStore).UpsertWorkflowExecution"
    write = "go.temporal.io/server/common/persistence/sql.(*sqlExecutionStore).UpdateWorkflowExecution"
    step = "modernc.org/sqlite/lib.Xsqlite3_step"
    for name in ("runtime.goexit", upsert, write, step):
        assert symbols.name(symbols.start_of(name) + 1) == name
    at = {name: f"{symbols.start_of(name) + 5 - symbols.load_address:x}" for name in (upsert, write, step)}
    samples = [[step, upsert], [step, write], [step, upsert], [write]]  # innermost first, as perf tells them
    script = "\n\n".join("\n".join(f"\t{at[frame]}" for frame in sample) for sample in samples)
    chains = call_chains(script.splitlines(), symbols)
    assert chains[1] == [step, write]
    lines = report(chains, top=5)
    assert "inside SQLite: 75.0% of the samples, asked for by:" in lines
    assert lines[-2:] == ["   66.7%  visibility UpsertWorkflowExecution", "   33.3%  UpdateWorkflowExecution"]
    # As bench/README.md runs it: `perf script -F ip -i PERF_DATA | python -m bench.server_profile`
    told = subprocess.run(
        [sys.executable, "-m", "bench.server_profile"], input=script, cwd=ROOT, capture_output=True, text=True
    )
    assert told.returncode == 0, told.stderr
    assert told.stdout.splitlines() == report(chains, top=30)  # its default --top


def running(name: str, node: str = "m-0000") -> Run:
    run = Run(name=name, submitted=datetime(2026, 12, 3, tzinfo=UTC), state="Running", worker="w-0", node=node)
    run.code, run.reason = R.WorkersRunning.code, R.WorkersRunning.fill(running=1, total=1).text
    run.worker_state, run.worker_code, run.worker_reason = "Running", R.ContainerRunning.code, "Container running"
    return run


def waiting(name: str, behind: str) -> Run:
    reason = R.QueuedBehind.fill(run=behind)
    run = Run(name=name, submitted=datetime(2026, 12, 3, tzinfo=UTC), state="Pending", worker="w-0")
    run.code, run.reason = reason.code, reason.text
    run.worker_state, run.worker_code, run.worker_reason = "Pending", reason.code, reason.text
    return run


def process(run: str, gpus: tuple[int, ...], node: str = "m-0000", attempt: int = 0, pid: int = 100) -> Interval:
    return Interval(run=f"burst/{run}", task="w-0", attempt=attempt, node=node, gpus=gpus, pid=pid, start=1.0)


def test_a_burst_whose_runs_and_processes_agree_keeps_its_invariants() -> None:
    runs = [running("run-0000"), running("run-0001", node="m-0001"), waiting("run-0002", "burst/run-0001")]
    workers = [process("run-0000", (0,)), process("run-0001", (0,), node="m-0001")]

    found = check(runs, workers, gpus=1)

    assert (found.workers, found.broken, lines(found)) == (2, 0, [])


def test_each_broken_invariant_is_named_with_its_worker_or_run() -> None:
    failed = running("run-0004")
    failed.state, failed.code, failed.reason = (
        "Failed",
        R.WorkerFailedRunFails.code,
        "A worker failed, and the run fails on a failure",
    )
    runs = [
        running("run-0000"),  # two processes of its one attempt
        running("run-0001"),  # holds GPU 1, as run-0000's second process does
        running("run-0002"),  # no process
        waiting("run-0003", "burst/run-0000"),  # waits, yet has a process
        failed,
        running("run-0005"),  # its process has no GPU
    ]
    workers = [
        process("run-0000", (0,), pid=1),
        process("run-0000", (1,), pid=2),
        process("run-0001", (1,), pid=3),
        process("run-0003", (2,), pid=4),
        process("run-0005", (), pid=5),
        Interval(run="idle/idle-000", task="w-0", attempt=0, node="m-0001", gpus=(0,), pid=6, start=1.0),
    ]

    found = check(runs, workers, gpus=1)

    assert found.started_twice == ["burst/run-0000/w-0: attempt 0 started 2 times (m-0000, m-0000)"]
    assert found.gpus_held_twice == ["m-0000 GPU 1: burst.run-0000.w-0.0 and burst.run-0001.w-0.0"]
    assert found.without_gpu == ["burst.run-0005.w-0.0 on m-0000: GPUs []"]
    assert found.unaccounted == [
        "burst/run-0000: Running, with 2 worker processes alive",
        "burst/run-0002: Running, with 0 worker processes alive",
        "burst/run-0003: Pending, with 1 worker process alive",
        "burst/run-0004: Failed: A worker failed, and the run fails on a failure",
    ]
    assert found.strays == ["idle.idle-000.w-0.0 on m-0001"]
    assert found.broken == 8
    assert lines(found)[0] == (
        "    1 x workers started twice, e.g. burst/run-0000/w-0: attempt 0 started 2 times (m-0000, m-0000)"
    )


def test_a_run_whose_process_is_elsewhere_than_it_says_is_unaccounted_for() -> None:
    found = check([running("run-0000", node="m-0001")], [process("run-0000", (0,), attempt=1)], gpus=1)

    assert found.unaccounted == [
        "burst/run-0000: its process is w-0 attempt 1 on m-0000, its run says w-0 attempt 0 on m-0001"
    ]
