"""A long history is folded in the run's record, and (protocol 4) the entries folded are kept to be passed on: put
back in place of the summary entry, they make the whole history again; `describe` and events read it in pages."""

from __future__ import annotations

from tests.domain.test_job import Story, running_story
from workflows.domain.run.events import HeartbeatLate, TaskRunning
from workflows.domain.run.status import StatusEntry, unfold
from workflows.domain.run.views import describe, events, page, paged, summarised, unfolded
from workflows.domain.settings import Settings


def flapping(protocol: int, keep: int) -> Story:
    """One worker whose heartbeat is late, then back, 20 times: 40 changes after it went Running."""
    story = running_story(1, settings=Settings(history_keep=keep))
    story.job.protocol = protocol
    for second in range(5, 45, 2):
        story.step(second, HeartbeatLate(task_id="w-0", attempt=0))
        story.step(second + 1, TaskRunning(task_id="w-0", attempt=0, heartbeat=True))
    return story


def test_the_entries_folded_since_protocol_4_put_back_make_the_whole_history() -> None:
    whole = flapping(4, keep=10_000).job.task("w-0").history
    story = flapping(4, keep=10)
    task = story.job.task("w-0")
    assert len(whole) > 40 and len(task.history) == 10 and task.summarised == len(whole) - 9
    assert story.job.folded.tasks["w-0"] == whole[3:-6]  # every entry the summary entry counts, oldest first
    assert unfold(task.history, story.job.folded.tasks["w-0"]) == whole
    assert story.job.folded.run == []  # the run's history is short: nothing folded


def test_before_protocol_4_nothing_folded_is_kept_and_the_summary_entry_stays() -> None:
    story = flapping(3, keep=10)
    task = story.job.task("w-0")
    assert story.job.folded.most() == 0 and task.summarised > 0
    assert unfold(task.history, []) == task.history
    assert task.history[3].code == "HistorySummarised"


def test_describe_unfolded_from_each_runs_part_is_whole_and_read_in_pages() -> None:
    whole = describe(flapping(4, keep=10_000).job)
    story = flapping(4, keep=10)
    held = describe(story.job)
    assert summarised(held) and not summarised(whole)
    folded = story.job.folded.tasks["w-0"]
    first, second = story.job.folded.model_copy(), story.job.folded.model_copy()  # two runs of the workflow
    first.tasks, second.tasks = {"w-0": folded[:7]}, {"w-0": folded[7:]}
    assert unfolded(held, [first, second]) == whole
    assert events(unfolded(held, [first, second])) == events(whole)
    page_of = paged(whole, after=5, limit=4)
    assert page_of.tasks[0].history == whole.tasks[0].history[5:9] and page_of.history == whole.history[5:9]
    assert page(events(whole), 40, None) == events(whole)[40:]


def test_a_history_never_folded_is_left_as_it_is() -> None:
    entries = flapping(4, keep=10_000).job.task("w-0").history
    stray = StatusEntry.model_validate(entries[0].model_dump())
    assert unfold(entries, [stray]) == entries
