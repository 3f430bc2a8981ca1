"""A history of every change on a real cluster: a worker that restarts for ever, its record folded at 10 entries, its
workflow continued as new again and again: `astraeus history`, `events` and `describe` still serve every change."""

from __future__ import annotations

import asyncio
import itertools
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest

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


async def runs_of(address: str, workflow_id: str) -> list[str]:
    """The ids of the workflow's runs, newest first: its latest one, and each one it was continued from."""
    client = await connect(address)
    run_id, runs = (await client.get_workflow_handle(workflow_id).describe()).run_id, []
    while run_id:
        runs.append(run_id)
        first = (await client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()).events[0]
        run_id = first.workflow_execution_started_event_attributes.continued_execution_run_id
    return runs


async def delete(address: str, workflow_id: str, run_id: str) -> None:
    """Delete one run of a workflow, as Temporal does once the namespace's retention has passed since it closed."""
    client = await connect(address)
    run = WorkflowExecution(workflow_id=workflow_id, run_id=run_id)
    request = DeleteWorkflowExecutionRequest(namespace=client.namespace, workflow_execution=run)
    await client.workflow_service.delete_workflow_execution(request)


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
    runs = asyncio.run(runs_of(cluster.address, "job/default/again"))
    assert len(runs) >= 3  # continued as new, more than once
    assert whole == task["history"] and history["run"] == described["history"]
    assert len(whole) > 10 and "HistorySummarised" not in {e["code"] for e in whole + history["run"]}
    assert all(a["at"] <= b["at"] for a, b in itertools.pairwise(whole))
    # Every attempt ran and shows it (none lost at a fold), but the last, which the cancel may have caught before
    # its machine started it.
    running = [i for i, e in enumerate(whole) if e["state"] == "Running"]
    after_last_run = {e["state"] for e in whole[running[-1] :]}
    assert len(running) == task["attempt"] + 1 or (len(running) == task["attempt"] and "Pending" in after_last_run)
    assert whole[0]["reason"] == "Waiting for workers to start"  # how it began
    assert len(stream) == len(whole) + len(history["run"])
    pages = [cluster.json("events", "again", "--after", str(n), "--limit", "15") for n in range(0, len(stream), 15)]
    assert [e for p in pages for e in p] == stream

    # Past the retention an earlier run is gone, and what it kept with it: the summary entry counts it again.
    asyncio.run(delete(cluster.address, "job/default/again", runs[1]))
    folded = cluster.wait_for(
        lambda: (h := cluster.json("history", "again")["tasks"]["w-0"])[3]["code"] == "HistorySummarised" and h,
        "the earlier run to be deleted",
    )
    assert len(folded) == 10 and folded[:3] == whole[:3] and folded[4:] == whole[-6:]
    assert folded[3]["reason"].startswith(f"{len(whole) - 9} earlier changes summarised, from ")
