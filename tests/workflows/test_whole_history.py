"""A history of every change, oldest first, across continue-as-new: a run whose worker restarts for ever, on the
time-skipping test server, read through the Python client and the CLI as a user reads it (workers/client.py)."""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path

from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from tests.workflows.fakes import Script, fake_cluster, unique
from tests.workflows.test_liveness import spec, start
from workers.client import AstraeusClient
from workers.outcomes import run_result
from workflows.domain.run.status import Folded, Status, StatusEntry
from workflows.domain.run.views import JobDescription, events
from workflows.domain.settings import Settings

ASTRAEUS = str(Path(sys.executable).parent / "astraeus")


async def runs_of(client: Client, workflow_id: str) -> int:
    """How many runs the workflow had: its latest one, and each one it was continued from."""
    run_id, count = (await client.get_workflow_handle(workflow_id).describe()).run_id, 0
    while run_id:
        count += 1
        handle = client.get_workflow_handle(workflow_id, run_id=run_id)
        first = (await handle.fetch_history()).events[0]
        run_id = first.workflow_execution_started_event_attributes.continued_execution_run_id
    return count


async def astraeus(env: WorkflowEnvironment, *args: str) -> tuple[str, str]:
    """The CLI, as a user runs it against this server: what it printed on stdout, and on stderr."""
    target = env.client.service_client.config.target_host
    process = await asyncio.create_subprocess_exec(
        ASTRAEUS, *args, "--temporal", target, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    return out.decode(), err.decode()


def counted(entries: list[StatusEntry]) -> int:
    """How many changes a folded history stands for: its entries, and those its summary entry counts."""
    summary = entries[3]
    assert summary.code == "HistorySummarised"
    return len(entries) - 1 + int(summary.reason.split()[0])


async def test_the_whole_history_of_a_run_that_continued_as_new_is_served_oldest_first_and_in_pages(
    own_time_skipping: WorkflowEnvironment,
) -> None:
    env = own_time_skipping  # a server of its own: others' activities in flight would stop time skipping
    job = spec(unique("forever"), restart_policy="Always")
    async with fake_cluster(env.client, Script(), Settings(continue_as_new_events=200, history_keep=30)):
        handle = await start(env, job)
        for _ in range(400):  # time skips only while the test server is asked to wait
            await env.sleep(10)
            held = await handle.query("describe", result_type=JobDescription)
            if held.tasks and held.tasks[0].attempt >= 50:
                break
        await handle.execute_update("cancel", result_type=Status)
        await run_result(handle)
        held = await handle.query("describe", result_type=JobDescription)  # what the last run's record holds
        client = AstraeusClient(env.client)
        described = await client.describe(job.namespace, job.name)
        stream = await client.events(job.namespace, job.name)
        pages = [await client.events(job.namespace, job.name, after=n, limit=100) for n in range(0, 400, 100)]
        page = await client.describe(job.namespace, job.name, after=200, limit=20)
        history, said = await astraeus(env, "history", job.name, "--json", "--after", "200", "--limit", "20")
        _, hint = await astraeus(env, "events", job.name, "--limit", "20")
        runs = await runs_of(env.client, job.job_id)

    # The record each workflow run holds stays bounded; the workflow continued as new many times.
    task = held.tasks[0]
    assert len(task.history) <= 30 and counted(task.history) > 200
    assert task.attempt >= 50 and runs >= 3
    # Every change of the run and of its worker, oldest first: how it began, each change that was folded, its
    # latest changes.
    whole = described.tasks[0].history
    for entries, bounded in ((whole, task.history), (described.history, held.history)):
        assert len(entries) == counted(bounded)
        assert entries[:3] == bounded[:3] and entries[-26:] == bounded[-26:]
        assert "HistorySummarised" not in {e.code for e in entries}
        assert all(a.at <= b.at for a, b in itertools.pairwise(entries))
    running = [e for e in whole if e.state == "Running"]
    assert len(running) == task.attempt + 1  # each attempt went Running once, none lost
    # Events are derived from that whole history, and read in pages.
    assert stream == events(described) and len(stream) == len(whole) + len(described.history)
    assert [e for p in pages for e in p] == stream[:400] and len(pages[0]) == 100
    assert page.tasks[0].history == whole[200:220] and page.history == described.history[200:220]
    # The CLI serves the same pages, and says how to read the next one.
    assert [StatusEntry.model_validate(e) for e in json.loads(history)["tasks"]["w-0"]] == whole[200:220]
    assert said == ""
    assert hint == f"more may follow: astraeus events {job.namespace}/{job.name} --after 20 --limit 20\n"


async def test_a_run_continues_as_new_before_it_holds_history_keep_folded_entries_of_one_history(
    own_time_skipping: WorkflowEnvironment,
) -> None:
    env = own_time_skipping
    job = spec(unique("bounded"), restart_policy="Always")
    held: list[int] = []  # how many folded entries of one history the workflow held, each time it was asked
    async with fake_cluster(env.client, Script(), Settings(history_keep=10)):  # continues as new past 4,000 events
        handle = await start(env, job)
        for _ in range(400):
            await env.sleep(10)
            held.append((await handle.query("folded", result_type=Folded)).most())
            described = await handle.query("describe", result_type=JobDescription)
            if described.tasks and described.tasks[0].attempt >= 20:
                break
        await handle.execute_update("cancel", result_type=Status)
        await run_result(handle)
        whole = await AstraeusClient(env.client).describe(job.namespace, job.name)
        runs = await runs_of(env.client, job.job_id)
    assert max(held) < 10 + 5  # history_keep, and at most what one decision adds before the quiet moment
    assert runs >= 10  # about 5 changes an attempt: it continued as new every 2 attempts or so
    assert len([e for e in whole.tasks[0].history if e.state == "Running"]) == whole.tasks[0].attempt + 1
