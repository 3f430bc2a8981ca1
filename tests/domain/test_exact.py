"""Reasons exact to the letter (issue 14): a run of another namespace in parentheses once, quantities printed
exactly, the spec's stop reason for the rest of a run a failed worker ends, and no literal outside the reasons."""

from __future__ import annotations

from datetime import timedelta

import pytest

from tests.domain.builders import T0, holding, machine, request
from tests.domain.test_job import Story, at, hello, running_story
from tests.domain.test_scheduling import outcome
from workflows.domain.reasons import ANOTHER_NAMESPACE, R, Template, all_templates, number
from workflows.domain.run.events import (
    Created,
    MachineLost,
    PlacementUpdate,
    Preempt,
    StopConfirmed,
    TaskEnded,
    TaskRunning,
    TaskStarted,
    Timer,
    TimerFired,
)
from workflows.domain.run.job import fail_undecided
from workflows.domain.run.lifecycle import derive_run
from workflows.domain.run.status import RunState, TaskState
from workflows.domain.run.tasks import groups_of, new_job, plan_tasks, split, task_request
from workflows.domain.scheduling.queue import schedule
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec

OTHER = ANOTHER_NAMESPACE


# ---- 1. "(a job in another namespace)" in parentheses once ---------------------------------------------------


@pytest.mark.parametrize(
    ("template", "values", "expected"),
    [
        pytest.param(
            R.QueuedBehindHigherPriority,
            {"run": OTHER},
            "Queued behind higher-priority work (a job in another namespace)",
            id="queued behind higher-priority work names the other namespace once",
        ),
        pytest.param(
            R.PreemptedByHigherPriority,
            {"run": OTHER},
            "Preempted by higher-priority work (a job in another namespace)",
            id="a preemption by another namespace names it once",
        ),
        pytest.param(
            R.PreemptedQueuedAgain,
            {"run": OTHER},
            "Preempted by (a job in another namespace); queued again",
            id="where the slot has no parentheses the name keeps its own",
        ),
        pytest.param(
            R.QueuedBehind, {"run": OTHER}, "Queued behind (a job in another namespace)", id="queued behind keeps them"
        ),
        pytest.param(
            R.PreemptedByHigherPriority,
            {"run": "urgent-eval"},
            "Preempted by higher-priority work (urgent-eval)",
            id="a run of the same namespace is named as before",
        ),
    ],
)
def test_another_namespace_is_in_parentheses_once(template: Template, values: dict[str, str], expected: str) -> None:
    assert template(**values).text == expected


def test_no_template_that_names_a_run_doubles_the_parentheses_of_another_namespace() -> None:
    naming = [t for t in all_templates() if {"run", "runs"} & set(t.fields)]
    for template in naming:
        values = {name: OTHER if name in ("run", "runs") else "x" for name in template.fields}
        text = template(**values).text
        assert OTHER in text and "((" not in text and "))" not in text, template.code


def test_a_run_preempted_by_another_namespace_waits_with_the_name_in_parentheses_once() -> None:
    story = running_story(1)
    story.step(5, Preempt(task_ids=["w-0"], by=OTHER))
    assert story.status("w-0") == ("Stopping", "Preempted by higher-priority work (a job in another namespace)")
    story.step(6, StopConfirmed(task_id="w-0", attempt=0))
    assert story.status("w-0") == ("Pending", "Preempted by (a job in another namespace); queued again")
    assert story.status() == (
        "Pending",
        "Preempted by higher-priority work (a job in another namespace); waiting to run again",
    )


# ---- 2. quantities printed exactly ------------------------------------------------------------------------------

GIB = 2**30


@pytest.mark.parametrize(
    ("value", "text"),
    [
        pytest.param(16 * GIB, "17179869184", id="bytes are exact integers, never 1.71799e+10"),
        pytest.param(float(16 * GIB), "17179869184", id="a whole float prints as an integer"),
        pytest.param(0.1 + 0.2, "0.3", id="cpu summed from tenths has no float noise"),
        pytest.param(1234.5678, "1234.5678", id="cpu keeps its digits, not 1234.57"),
        pytest.param(2_000_000.0, "2000000", id="a large cpu is never in exponent form"),
        pytest.param(0.25, "0.25", id="a quarter core"),
        pytest.param(0, "0", id="zero"),
    ],
)
def test_numbers_in_reasons_are_exact(value: float, text: str) -> None:
    assert number(value) == text


# ---- 4. the spec's stop reason for the rest of a run a failed worker ends ----------------------------------------

FAILS = "A worker failed, and the run fails on a failure"


def test_a_worker_that_fails_for_good_stops_the_rest_with_the_specs_reason() -> None:
    story = running_story(3, policy="Never")
    story.step(5, TaskEnded(task_id="w-1", attempt=0, exit_code=3))
    assert story.status() == ("Failed", "Worker w-1 failed on n1: Exited with code 3")
    assert [story.status(t) for t in ("w-0", "w-2")] == [("Stopping", FAILS), ("Stopping", FAILS)]


def test_a_worker_lost_for_good_stops_the_rest_with_the_specs_reason() -> None:
    story = running_story(2, policy="Never")
    story.step(5, MachineLost(node="n0"))
    assert story.status() == ("Failed", "Worker w-0 was lost on n0: Machine lost: its lease expired")
    assert story.status("w-1") == ("Stopping", FAILS)


def test_a_worker_out_of_its_budget_stops_the_rest_with_the_specs_reason() -> None:
    story = running_story(2, settings=Settings(restart_budget=0))
    story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=1))
    assert story.status() == (
        "Failed",
        "Worker w-0 failed on n0: Retry budget exhausted after 0/0 restarts",
    )
    assert story.status("w-1") == ("Stopping", FAILS)


def test_a_worker_that_ran_out_of_time_stops_the_rest_with_the_time_limit_reason() -> None:
    story = Story(hello(2, time_limit_seconds=60))
    story.step(1, Created())
    story.step(2, *[PlacementUpdate(task_id=t, attempt=0, node=f"n{i}") for i, t in enumerate(("w-0", "w-1"))])
    story.step(3, *[TaskStarted(task_id=t, attempt=0) for t in ("w-0", "w-1")])
    story.step(4, *[TaskRunning(task_id=t, attempt=0) for t in ("w-0", "w-1")])
    story.step(64, TimerFired(timer=Timer.TIME_LIMIT, task_id="w-0", attempt=0))
    story.step(65, StopConfirmed(task_id="w-0", attempt=0))
    assert story.status() == ("Failed", "Worker w-0: Exceeded its time limit of 1m")
    assert story.status("w-1") == ("Stopping", "A worker exceeded its time limit")


def test_a_run_failed_for_another_cause_stops_its_workers_with_run_failed() -> None:
    story = running_story(2)
    failed, _ = fail_undecided(story.job, "KeyError: 'w-9'", at(5) + timedelta(seconds=1))
    assert failed.status.reason == "Cannot be decided: KeyError: 'w-9'"
    assert [t.status.reason for t in failed.tasks] == ["Run failed", "Run failed"]


# ---- 10. a failure with no machine to name ----------------------------------------------------------------------


def test_a_worker_that_failed_for_good_with_no_machine_gets_a_reason_of_the_reasons_module() -> None:
    story = running_story(1, policy="Never")
    story.step(5, TaskEnded(task_id="w-0", attempt=0, exit_code=3))
    ended = story.job.task("w-0")
    task = ended.model_copy(update={"attempt": ended.attempt.model_copy(update={"node": None})})
    assert task.state is TaskState.FAILED and task.final
    derived = derive_run([task], RunState.RUNNING)
    assert derived is not None
    assert (derived[1].code, derived[1].text) == ("WorkerFailedNowhere", "Worker w-0 failed: Exited with code 3")


# ---- 7. a group of total_gpus: one worker per machine ----------------------------------------------------------


def test_the_workers_of_a_planned_group_ask_to_spread_and_others_do_not() -> None:
    spec = parse_spec(
        {
            "name": "split",
            "groups": [
                {"name": "train", "total_gpus": 4, "machines": 2, "command": ["x"]},
                {"name": "eval", "command": ["x"]},
            ],
        }
    )
    job = new_job(spec, Settings(), at(0))
    job.planned["train"] = split(spec.groups[0], 2, 2)
    job.tasks = plan_tasks(groups_of(job), at(0))
    assert [(t.id, task_request(job, t).spread) for t in job.tasks] == [
        ("train-0", True),
        ("train-1", True),
        ("eval-0", False),
    ]


def test_two_workers_of_a_planned_group_never_share_a_machine() -> None:
    nodes = [machine("n0", gpus=4), machine("n1", gpus=4)]
    workers = [request(f"w-{i}", gpus=2, spread=True) for i in range(2)]
    assert outcome(schedule(workers, nodes, [], T0)) == {"a/w-0": "n0", "a/w-1": "n1"}
    # Without spread, best fit packs them on one machine: what a planned group did before.
    packed = [request(f"w-{i}", gpus=2) for i in range(2)]
    assert outcome(schedule(packed, nodes, [], T0)) == {"a/w-0": "n0", "a/w-1": "n0"}


def test_a_planned_worker_waits_rather_than_join_its_group_on_a_machine_and_says_why() -> None:
    nodes = [machine("n0", gpus=8)]
    placed = holding("n0", run="a", task="w-0", gpus=2, group="w")
    plan = schedule([request("w-1", gpus=2, spread=True)], nodes, [placed], T0)
    (decision,) = plan.decisions
    assert decision.node is None
    assert decision.reason is not None and decision.reason.text == "No machine fits: 1 of 1 machines ready"
    assert [(n.name, n.texts) for n in decision.nodes] == [
        ("n0", ["another worker of this run is already on the machine"])
    ]


def test_a_planned_worker_shares_a_machine_with_another_group_of_its_run() -> None:
    nodes = [machine("n0", gpus=8)]
    other_group = holding("n0", run="a", task="eval-0", gpus=0, group="eval")
    plan = schedule([request("w-1", gpus=2, spread=True)], nodes, [other_group], T0)
    assert [d.node for d in plan.decisions] == ["n0"]


def test_a_gang_of_a_planned_group_is_placed_one_member_per_machine() -> None:
    nodes = [machine("n0", gpus=8), machine("n1", gpus=8)]
    members = [request(f"w-{i}", gpus=4, spread=True, gang=True) for i in range(2)]
    assert outcome(schedule(members, nodes, [], T0)) == {"a/w-0": "n0", "a/w-1": "n1"}
