"""`make demo`: examples/hello.yaml goes Pending → Running → Completed with the spec's reasons, and ends by itself."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_the_demo_runs_hello_to_completion_and_stops() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "workers.demo", "examples/hello.yaml"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Temporal UI: http://127.0.0.1:" in out
    lines = [line.split(None, 4)[2:] for line in out.splitlines() if line[:2].isdigit()]  # after the time and zone
    assert ["run", "Pending", "Run created"] in lines
    assert ["run", "Running", "2 of 2 workers running"] in lines or [
        "run",
        "Running",
        "1 of 2 workers running",
    ] in lines
    assert ["worker-0", "Running", "Container running"] in lines
    assert ["worker-1", "Completed", "Exited with code 0"] in lines
    assert (
        lines[-1] == ["run", "Completed", "All workers completed"]
        or ["run", "Completed", "All workers completed"] in lines
    )
    assert out.rstrip().endswith(
        "The run ended Completed: All workers completed. The demo stopped everything it started."
    )
