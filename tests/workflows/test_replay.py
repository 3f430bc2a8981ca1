"""Committed histories replay against today's workflow code: determinism is guarded (see tests/histories)."""

from __future__ import annotations

from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer

from workflows.job import JobWorkflow
from workflows.node import NodeWorkflow

HISTORIES = sorted((Path(__file__).parent.parent / "histories").glob("*.json"))


def test_histories_are_committed() -> None:
    protocol_1 = {"hello", "fail", "restarts", "cancel", "gang", "groups"}
    protocol_2 = {f"{name}-p2" for name in [*protocol_1, "ui-cancel"]}
    protocol_3 = {f"{name}-p3" for name in [*protocol_1, "ui-cancel"]}
    protocol_5 = {f"{name}-p5" for name in [*protocol_1, "ui-cancel"]}  # 4 issues the same commands as 3 for these
    protocol_6 = {f"{name}-p6" for name in [*protocol_1, "ui-cancel"]}  # the difference from what is in flight
    # load_settings places the first workers (the run calls no `place` for them)
    admitted = {f"{name}-p6a" for name in [*protocol_1, "ui-cancel"]}
    # Each run of a workflow that continued as new has a history of its own: the later ones begin from the record.
    continued = {"continues-p5", "continues-1-p5", "continues-2-p5", "continues-p6", "continues-1-p6", "continues-2-p6"}
    # Protocol 7: a watch has no heartbeat (its machine's lease carries its liveness); heard: the machine late, heard
    # again, and a new agent (its watch attached again)
    protocol_7 = {f"{name}-p7" for name in [*protocol_1, "ui-cancel", "heard"]}
    node = {"node-life", "node-continued", "node-liveness"}  # NodeWorkflow (tests/histories/record_node.py)
    late = {"late-settings-p6a"}  # a workflow task completed empty while load_settings ran: it recorded its `at`
    assert (
        {p.stem for p in HISTORIES}
        >= protocol_1
        | protocol_2
        | protocol_3
        | protocol_5
        | protocol_6
        | protocol_7
        | admitted
        | continued
        | node
        | late
    )


@pytest.mark.parametrize("path", HISTORIES, ids=[p.stem for p in HISTORIES])
async def test_a_committed_history_replays(path: Path) -> None:
    history = WorkflowHistory.from_json(f"job/default/{path.stem.split('-p')[0]}", path.read_text())
    replayer = Replayer(workflows=[JobWorkflow, NodeWorkflow], data_converter=pydantic_data_converter)
    await replayer.replay_workflow(history)
