"""The long-running commands run with the garbage collector set for them (workers/collector.py); the others keep
CPython's defaults. Each case runs in an interpreter of its own, as the commands do."""

from __future__ import annotations

import subprocess
import sys

from workers.collector import YOUNG_THRESHOLD

REPORT = "import gc; print(gc.get_threshold()[0], gc.get_freeze_count() > 0)"


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.strip().splitlines()[-1]


def test_tuning_freezes_what_the_process_holds_once_and_collects_young_objects_less_often() -> None:
    code = (
        "import gc; from workers import collector; collector.tune(); frozen = gc.get_freeze_count(); "
        "keep = [[] for _ in range(1000)]; collector.tune(); "
        "print(gc.get_threshold()[0], frozen > 0, gc.get_freeze_count() == frozen)"
    )
    assert _python(code) == f"{YOUNG_THRESHOLD} True True"


def test_a_service_command_tunes_the_collector_and_a_one_shot_command_does_not() -> None:
    agent = ["agent", "--name", "m1", "--mesh-endpoint", "192.0.2.1", "--temporal", "127.0.0.1:1"]  # refused early
    assert _python(f"from workers.cli import run; run({agent!r}); {REPORT}") == f"{YOUNG_THRESHOLD} True"
    assert _python(f"from workers.cli import run; run(['schema']); {REPORT}") == "700 False"
