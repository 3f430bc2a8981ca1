"""`bench.burst` keeps working: a tiny burst prints its figures and exits 0, and waiting reasons group by cause."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.burst_report import pattern

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
def test_a_tiny_burst_prints_its_figures_and_exits_0(tmp_path: Path) -> None:
    """6 runs on 2 machines x 2 GPUs: 4 Running, 2 waiting with a reason, then a floor of 3 bare workflows."""
    figures_file = tmp_path / "burst.json"
    args = ["--runs", "6", "--machines", "2", "--gpus", "2", "--idle", "1", "--floor-runs", "3"]
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
    ):
        assert label in result.stdout, result.stdout
    figures = json.loads(figures_file.read_text())
    assert (figures["submitted"], figures["running"]) == (6, 4)
    assert sum(item["runs"] for item in figures["reasons_now"]) == 2
    assert figures["floor"]["completed"] == 3


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
