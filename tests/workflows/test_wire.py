"""What crosses the wire: each signal and agent update carries its domain event itself, through the pydantic data
converter every client uses; reasons travel whole (code and sentence), per-machine ones included; and payloads of
the shapes sent before (in committed histories and in the records of runs that continued as new) still decode."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.domain.builders import T0, machine, request
from tests.domain.test_job import Story, hello
from workflows import contracts
from workflows.domain.inventory import NodeInventory
from workflows.domain.machine.decisions import GpusReported, OrphanStopped, PressureReported, Registered
from workflows.domain.reasons import UNCODED, NodeReasons, R, Reason
from workflows.domain.run.events import (
    Created,
    ExitedWhileLost,
    MachineHeard,
    MachineLost,
    PlacementUpdate,
    Preempt,
    TaskHealth,
    TaskProgress,
    TaskRunning,
)
from workflows.domain.run.status import JobRecord, Placement, PlacementNode
from workflows.domain.run.views import describe
from workflows.domain.scheduling.queue import schedule
from workflows.messages import JobInput, PlaceResult

CONVERTER = pydantic_data_converter.payload_converter

WAITING = PlacementUpdate(
    task_id="w-0",
    attempt=1,
    reason=R.NoMachineFits(ready=1, total=2),
    nodes=[
        NodeReasons(name="n0", reasons=[R.NodeNotReady(state="Down")]),
        NodeReasons(name="n1", reasons=[R.Cordoned(why="repairs"), R.InsufficientGpus(need=8, free=4)]),
    ],
    quota_reached=R.QuotaReached(why="gpus 8 in use + 1 asked > 8"),
)

# One message of each signal and of each update an agent sends, by the name it travels by.
SAMPLES: dict[str, BaseModel] = {
    contracts.PLACEMENT.name: WAITING,
    contracts.PREEMPT.name: Preempt(task_ids=["w-0", "w-1"], by="(a job in another namespace)"),
    contracts.TASK_PROGRESS.name: TaskProgress(
        task_id="w-0", attempt=0, pulling=True, reason=R.Pulling(image="busybox"), picked_up_at=T0
    ),
    contracts.TASK_RUNNING.name: TaskRunning(task_id="w-0", attempt=2, started=True, picked_up_at=T0, started_at=T0),
    contracts.TASK_HEALTH.name: TaskHealth(task_id="w-0", attempt=0, healthy=False, detail="exit 1"),
    contracts.MACHINE_LOST.name: MachineLost(node="n0", removed=True, lost_at=T0),
    contracts.MACHINE_HEARD.name: MachineHeard(node="n0", late=False, at=T0, new_agent=True),
    contracts.TASK_EXITED_WHILE_LOST.name: ExitedWhileLost(task_id="w-0", attempt=3, node="n0"),
    contracts.REGISTER.name: Registered(
        inventory=NodeInventory(name="n0", cpus=8, memory_bytes=1 << 30), instance="h:1:t", take_over="h:0:s"
    ),
    contracts.REPORT_GPUS.name: GpusReported(gpus=[]),
    contracts.REPORT_PRESSURE.name: PressureReported(pressure=["memory"]),
    contracts.REPORT_ORPHAN_STOPPED.name: OrphanStopped(task="w-0", run="default/r", status="terminated", attempt=2),
}


def through_the_wire(message: Any, as_type: Any) -> Any:
    """What the receiver decodes of `message`, sent with the project's data converter."""
    [payload] = CONVERTER.to_payloads([message])
    [decoded] = CONVERTER.from_payloads([payload], [as_type])
    return decoded


def json_of(message: BaseModel) -> dict[str, Any]:
    [payload] = CONVERTER.to_payloads([message])
    data: dict[str, Any] = json.loads(payload.data)
    return data


def test_every_signal_and_every_agent_update_has_a_sample() -> None:
    agents = {contracts.REGISTER, contracts.REPORT_GPUS, contracts.REPORT_PRESSURE, contracts.REPORT_ORPHAN_STOPPED}
    assert set(SAMPLES) == {s.name for s in contracts.SIGNALS} | {u.name for u in agents}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_message_comes_back_through_the_data_converter_as_it_was_sent(name: str) -> None:
    sent = SAMPLES[name]
    declared = next(m.input for m in [*contracts.SIGNALS, *contracts.UPDATES] if m.name == name)
    assert type(sent) is declared  # the payload is the receiver's domain event itself
    assert through_the_wire(sent, declared) == sent


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_an_events_kind_stays_off_the_wire(name: str) -> None:
    """The signal's name says which event it is; the JSON keeps the keys it had when each signal had its model."""
    assert "kind" not in json_of(SAMPLES[name])


def test_the_json_of_a_report_is_what_it_was() -> None:
    running = SAMPLES[contracts.TASK_RUNNING.name]
    assert json_of(running) == {
        "task_id": "w-0",
        "attempt": 2,
        "heartbeat": False,
        "started": True,
        "picked_up_at": "2025-01-01T12:00:00Z",
        "started_at": "2025-01-01T12:00:00Z",
    }


def test_a_reason_travels_whole_with_its_code() -> None:
    assert json_of(WAITING)["reason"] == {"code": "NoMachineFits", "text": "No machine fits: 1 of 2 machines ready"}
    assert json_of(WAITING)["nodes"][1]["reasons"] == [
        {"code": "Cordoned", "text": "machine is cordoned: repairs"},
        {"code": "InsufficientGpus", "text": "insufficient gpus: need 8, 4 free and usable"},
    ]


def test_the_place_result_comes_back_with_its_answers() -> None:
    result = PlaceResult(answers=[WAITING, PlacementUpdate(task_id="w-1", attempt=0, node="n1", address="10.0.0.1")])
    assert through_the_wire(result, PlaceResult) == result


# ---- shapes sent before ---------------------------------------------------------------------------------------------


def old(payload: dict[str, Any], as_type: Any) -> Any:
    """A payload as a sender of an earlier version wrote it, decoded now."""
    [decoded] = CONVERTER.from_payloads([CONVERTER.to_payloads([payload])[0]], [as_type])
    return decoded


def test_an_old_answer_that_waits_reads_its_reason_pair_and_sentences() -> None:
    payload = {
        "task_id": "w-0",
        "attempt": 1,
        "node": None,
        "address": None,
        "code": "NoMachineFits",
        "reason": "No machine fits: 1 of 2 machines ready",
        "nodes": [{"name": "n1", "reasons": ["machine is cordoned: repairs"]}],
        "quota_reached": "Quota reached: gpus 8 in use + 1 asked > 8",
    }
    assert old(payload, PlacementUpdate) == PlacementUpdate(
        task_id="w-0",
        attempt=1,
        reason=Reason("NoMachineFits", "No machine fits: 1 of 2 machines ready"),
        nodes=[NodeReasons(name="n1", reasons=[Reason(UNCODED, "machine is cordoned: repairs")])],
        quota_reached=Reason("QuotaReached", "Quota reached: gpus 8 in use + 1 asked > 8"),
    )


def test_an_old_answer_with_a_machine_has_no_reason() -> None:
    payload = {"task_id": "w-0", "attempt": 0, "node": "n0", "address": "10.0.0.5", "code": "", "reason": ""}
    payload |= {"nodes": [], "quota_reached": ""}
    assert old(payload, PlacementUpdate) == PlacementUpdate(task_id="w-0", attempt=0, node="n0", address="10.0.0.5")
    assert old({"answers": [payload]}, PlaceResult).answers[0].reason is None  # the `place` marker's result


def test_an_old_progress_report_reads_its_reason_pair() -> None:
    payload = {"task_id": "w-0", "attempt": 0, "pulling": True, "code": "Pulling", "reason": "Pulling busybox"}
    assert old(payload | {"picked_up_at": None}, TaskProgress) == TaskProgress(
        task_id="w-0", attempt=0, pulling=True, reason=Reason("Pulling", "Pulling busybox")
    )


def test_old_reports_without_the_later_fields_still_decode() -> None:
    assert old({"task_id": "w-0", "attempt": 0, "heartbeat": False}, TaskRunning) == TaskRunning(
        task_id="w-0", attempt=0
    )
    assert old({"node": "n0"}, MachineLost) == MachineLost(node="n0")


def test_a_run_continued_before_keeps_its_machines_sentences() -> None:
    """The record a run continued as new with, from before reasons kept their codes: each sentence is kept, its
    code UNCODED, and describe shows it as it did."""
    story = Story(hello(1, gpus=8))
    story.step(1, Created())
    story.step(2, WAITING)
    record = story.job.model_dump(mode="json")
    record["tasks"][0]["waiting_on"] = [{"name": "n1", "reasons": ["machine is cordoned: repairs"]}]
    job = old({"spec": record["spec"], "record": record}, JobInput).record
    assert isinstance(job, JobRecord)
    assert describe(job).placement == Placement(
        nodes=[PlacementNode(name="n1", reasons=["machine is cordoned: repairs"])], counts={UNCODED: 1}
    )


# ---- a per-machine reason keeps its code from the scheduler to describe ---------------------------------------------


def test_a_machines_reason_keeps_its_code_from_the_scheduler_through_the_run() -> None:
    nodes = [machine("n0", gpus=8, cordon="repairs"), machine("n1", gpus=4), machine("n2", gpus=4)]
    [decision] = schedule([request(gpus=8)], nodes, [], T0).decisions
    assert decision.reason is not None
    sent = PlacementUpdate(task_id="w-0", attempt=0, reason=decision.reason, nodes=decision.nodes)
    received = through_the_wire(sent, contracts.PLACEMENT.input)
    assert [[r.code for r in n.reasons] for n in received.nodes] == [
        ["Cordoned"],
        ["InsufficientGpus"],
        ["InsufficientGpus"],
    ]
    story = Story(hello(1, gpus=8))
    story.step(1, Created())
    story.step(2, received)
    continued = through_the_wire(JobInput(spec=story.job.spec, record=story.job), JobInput).record
    assert continued.tasks[0].waiting_on == received.nodes  # continue-as-new carries the codes too
    assert describe(continued).placement == Placement(
        nodes=[
            PlacementNode(name="n0", reasons=["machine is cordoned: repairs"]),
            PlacementNode(name="n1", reasons=["insufficient gpus: need 8, 4 free and usable"]),
            PlacementNode(name="n2", reasons=["insufficient gpus: need 8, 4 free and usable"]),
        ],
        counts={"InsufficientGpus": 2, "Cordoned": 1},
    )
    assert story.job.task("w-0").status.reason == "No machine fits: 3 of 3 machines ready"


def test_counts_say_how_many_machines_give_each_reason_most_first() -> None:
    nodes = [
        NodeReasons(name="a", reasons=[R.Cordoned(why="x"), R.InsufficientGpus(need=8, free=0)]),
        NodeReasons(name="b", reasons=[R.InsufficientGpus(need=8, free=4)]),
        NodeReasons(name="c", reasons=[R.NodeNotReady(state="Down")]),
    ]
    assert list(Placement.of(nodes).counts.items()) == [("InsufficientGpus", 2), ("Cordoned", 1), ("NodeNotReady", 1)]


def test_a_report_with_external_access_carries_where_people_reach_it() -> None:
    from workflows.domain.run.events import TaskRunning

    sent = TaskRunning(task_id="w-0", attempt=0, started=True, external={"web": "10.0.0.7:30001"})
    assert json_of(sent)["external"] == {"web": "10.0.0.7:30001"}
    assert through_the_wire(sent, TaskRunning) == sent


def test_a_report_of_a_worker_on_the_node_network_carries_its_address_there_and_others_none() -> None:
    from workflows.domain.run.events import TaskRunning

    sent = TaskRunning(task_id="w-0", attempt=0, started=True, node_address="10.200.1.2")
    assert json_of(sent)["node_address"] == "10.200.1.2"
    assert through_the_wire(sent, TaskRunning) == sent
    assert "node_address" not in json_of(TaskRunning(task_id="w-0", attempt=0, started=True))
