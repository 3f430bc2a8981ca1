"""A history of every change on a real cluster: a worker that restarts for ever, its record folded at 10 entries, its
workflow continued as new again and again: `astraeus history`, `events` and `describe` still serve every change."""

from __future__ import annotations

import asyncio
import itertools
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import Cluster
from workers.connect import connect

pytestmark = pytest.mark.integration


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    # Continued as new past 50 events too, so that even a control plane that folds away what it folds does.
    c = Cluster(tmp_path, history_keep=10, continue_as_new_events=50, backoff_base_seconds=0.2, backoff_cap_seconds=0.2)
    try:
        c.start({"a": ["--cpus", "2"]})
        yield c
    finally:
        c.stop()


async def runs_of(address: str, workflow_id: str) -> int:
    """How many runs the workflow had: its latest one, and each one it was continued from."""
    client = await connect(address)
    run_id, count = (await client.get_workflow_handle(workflow_id).describe()).run_id, 0
    while run_id:
        count += 1
        first = (await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()).events[0]
        run_id = first.workflow_execution_started_event_attributes.continued_execution_run_id
    return count


def test_every_change_of_a_run_that_continued_as_new_is_served_oldest_first(cluster: Cluster, tmp_path: Path) -> None:
    spec = tmp_path / "again.yaml"
    spec.write_text(
        textwrap.dedent("""\
        name: again
        groups: [{name: w, command: ["true"], cpu: 1, restart_policy: Always}]
        """)
    )
    cluster.cli("submit", str(spec))
    cluster.wait_for(lambda: cluster.describe("again")["tasks"][0]["attempt"] >= 8, "8 attempts", timeout=120)
    cluster.cli("cancel", "again")
    cluster.wait_state("again", "Cancelled")

    described = cluster.describe("again")
    history = cluster.json("history", "again")
    stream = cluster.json("events", "again")
    task = described["tasks"][0]
    whole = history["tasks"]["w-0"]
    assert asyncio.run(runs_of(cluster.address, "job/default/again")) >= 3  # continued as new, more than once
    assert whole == task["history"] and history["run"] == described["history"]
    assert len(whole) > 10 and "HistorySummarised" not in {e["code"] for e in whole + history["run"]}
    assert all(a["at"] <= b["at"] for a, b in itertools.pairwise(whole))
    assert len([e for e in whole if e["state"] == "Running"]) == task["attempt"] + 1  # every attempt, none lost
    assert whole[0]["reason"] == "Waiting for workers to start"  # how it began
    assert len(stream) == len(whole) + len(history["run"])
    pages = [cluster.json("events", "again", "--after", str(n), "--limit", "15") for n in range(0, len(stream), 15)]
    assert [e for p in pages for e in p] == stream
