"""The scheduler service around the pure core, with a fake Temporal client that records every signal: what it
tells runs, whom it preempts and how, what it holds back, and that a rebuilt service decides the same."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import BaseModel
from temporalio.client import WorkflowExecutionStatus
from temporalio.common import SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.service import RPCError, RPCStatusCode

from activities.scheduler import NODES_REFRESH_SECONDS, SchedulerService
from tests.domain.builders import T0, holding, machine, request
from workflows.domain.constraints import Drive
from workflows.domain.inventory import NodeView
from workflows.domain.reasons import Reason
from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.run.events import MachineLost, PlacementUpdate, Preempt
from workflows.domain.scheduling.quotas import Quota
from workflows.messages import (
    DrivesChangedInput,
    NodeChangedInput,
    PlaceInput,
    PlanInput,
    QuotasChangedInput,
    ReleaseInput,
    RemoveDriveRequest,
    SchedulerView,
)

PRIORITY = SearchAttributeKey.for_int("AstraeusPriority")


@dataclass
class _Listed:
    id: str
    typed_search_attributes: TypedSearchAttributes


@dataclass
class FakeCluster:
    """The durable truth as the service reads it, and every signal it sends."""

    nodes: dict[str, NodeView] = field(default_factory=dict)
    runs: dict[str, tuple[int, SchedulerView]] = field(default_factory=dict)
    quotas: list[Quota] | None = None
    drives: list[Drive] | None = None
    gone: set[str] = field(default_factory=set)
    signals: list[tuple[str, str, BaseModel]] = field(default_factory=list)

    def sent(self, name: str) -> list[tuple[str, Any]]:
        return [(job, message) for job, signal, message in self.signals if signal == name]


@dataclass
class _Described:
    status: WorkflowExecutionStatus


class _Handle:
    def __init__(self, cluster: FakeCluster, workflow_id: str) -> None:
        self.cluster, self.id = cluster, workflow_id

    async def signal(self, name: str, message: BaseModel) -> None:
        if self.id in self.cluster.gone:
            raise RPCError("not found", RPCStatusCode.NOT_FOUND, b"")
        self.cluster.signals.append((self.id, name, message))

    async def describe(self) -> Any:
        if self.id in self.cluster.gone:
            raise RPCError("not found", RPCStatusCode.NOT_FOUND, b"")
        return _Described(WorkflowExecutionStatus.RUNNING)

    async def query(self, name: str, result_type: Any = None) -> Any:
        if name == "view":
            return self.cluster.nodes[self.id.removeprefix("node/")]
        if name == "scheduler_view":
            return self.cluster.runs[self.id][1]
        if name == "quotas":
            if self.cluster.quotas is None:
                raise RPCError("not found", RPCStatusCode.NOT_FOUND, b"")
            return self.cluster.quotas
        if name == "drives":
            if self.cluster.drives is None:
                raise RPCError("not found", RPCStatusCode.NOT_FOUND, b"")
            return self.cluster.drives
        raise AssertionError(name)


class FakeClient:
    def __init__(self, cluster: FakeCluster) -> None:
        self.cluster = cluster

    def get_workflow_handle(self, workflow_id: str) -> _Handle:
        return _Handle(self.cluster, workflow_id)

    async def list_workflows(self, query: str) -> AsyncIterator[_Listed]:
        if "AstraeusNodes" in query:
            return  # no run here predates the scheduler's own record of who is where
        if "NodeWorkflow" in query:
            for name in self.cluster.nodes:
                yield _Listed(f"node/{name}", TypedSearchAttributes([]))
        else:
            for job_id, (priority, _) in self.cluster.runs.items():
                yield _Listed(job_id, TypedSearchAttributes([SearchAttributePair(PRIORITY, priority)]))


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


async def service(cluster: FakeCluster, clock: Clock | None = None) -> SchedulerService:
    svc = SchedulerService(FakeClient(cluster), clock or Clock())  # type: ignore[arg-type]
    await svc.rebuild()
    await svc.outbox.idle()
    return svc


async def place(svc: SchedulerService, *requests: TaskRequest) -> None:
    """A run's `place` call: its answers (in the call's result) are kept with the signals, in the order told."""
    result = await svc.place(PlaceInput(requests=list(requests)))
    for answer in result.answers:  # the run hears its result before any signal sent after it
        job = next(r.job_id for r in requests if r.task_id == answer.task_id)
        svc._client.cluster.signals.append((job, "placement", answer))  # type: ignore[attr-defined]
    await svc.outbox.idle()


def placements(cluster: FakeCluster) -> list[tuple[str, str, str | None, str]]:
    return [(job, u.task_id, u.node, u.reason.text if u.reason else "") for job, u in cluster.sent("placement")]


async def test_a_worker_that_fits_is_placed_and_told_so() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    await place(svc, request(gpus=2))
    assert placements(cluster) == [("job/default/a", "w-0", "n0", "")]


async def test_a_retried_place_gets_the_same_answer_and_nothing_is_placed_twice() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    req = request(gpus=8)
    await place(svc, req)
    await place(svc, req)
    await place(svc, request(run="b", gpus=8))
    assert placements(cluster) == [
        ("job/default/a", "w-0", "n0", ""),
        ("job/default/a", "w-0", "n0", ""),
        ("job/default/b", "w-0", None, "Next to run (priority 0): waits for running work to end"),
    ]


async def test_an_unchanged_reason_is_not_sent_again() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=2)})
    svc = await service(cluster)
    await place(svc, request(gpus=8))
    await svc.node_changed(NodeChangedInput(node=machine("n0", gpus=2)))
    await svc.outbox.idle()
    assert len(placements(cluster)) == 1


async def test_changed_machine_reasons_under_the_same_reason_wait_for_the_refresh() -> None:
    clock = Clock()
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=4)})
    svc = await service(cluster, clock)
    await place(svc, request(run="big", gpus=64))
    await place(svc, request(run="small", gpus=2))  # n0 now has 2 free
    assert [u.nodes[0].texts for _, u in cluster.sent("placement") if u.node is None] == [
        ["insufficient gpus: need 64, 4 free and usable"]
    ]
    clock.now = T0 + timedelta(seconds=NODES_REFRESH_SECONDS)
    await svc.node_changed(NodeChangedInput(node=machine("n0", gpus=4)))
    await svc.outbox.idle()
    assert [u.nodes[0].texts for _, u in cluster.sent("placement") if u.node is None][-1] == [
        "insufficient gpus: need 64, 2 free and usable"
    ]


async def test_preemption_signals_the_victims_run_and_the_head_follows_their_release() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    await place(svc, request(run="low", gpus=8))
    await place(svc, request(run="urgent", priority=10, gpus=8))
    assert cluster.sent("preempt") == [("job/default/low", Preempt(task_ids=["w-0"], by="urgent"))]
    assert placements(cluster)[-1] == (
        "job/default/urgent",
        "w-0",
        None,
        "Preempting 1 lower-priority worker(s) of low to start",
    )
    # The victim's run asks to place it again before its old attempt is released: it waits.
    await place(svc, request(run="low", gpus=8).model_copy(update={"attempt": 1}))
    assert cluster.sent("preempt") == [("job/default/low", Preempt(task_ids=["w-0"], by="urgent"))]
    assert placements(cluster)[-2:] == [
        ("job/default/urgent", "w-0", None, "Starting: waiting for 1 preempted worker(s) to stop"),
        ("job/default/low", "w-0", None, "Queued behind higher-priority work (urgent)"),
    ]
    await svc.release(ReleaseInput(job_id="job/default/low", task_id="w-0", attempt=0))
    await svc.outbox.idle()
    assert sorted(placements(cluster)[-2:]) == [
        ("job/default/low", "w-0", None, "Next to run (priority 0): waits for running work to end"),
        ("job/default/urgent", "w-0", "n0", ""),
    ]


async def test_a_victim_is_told_only_once() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    await place(svc, request(run="low", gpus=8))
    await place(svc, request(run="urgent", priority=10, gpus=8))
    await place(svc, request(run="urgent2", priority=20, gpus=8))
    assert [job for job, _ in cluster.sent("preempt")] == ["job/default/low"]


async def test_quotas_change_what_waits() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    await svc.quotas_changed(QuotasChangedInput(quotas=[Quota(namespace="default", gpus=2)]))
    await svc.outbox.idle()
    await place(svc, request(gpus=4))
    assert placements(cluster) == [
        (
            "job/default/a",
            "w-0",
            None,
            "Waits for more than the namespace's quota allows at all (gpus 4 asked > 2): "
            "raise the quota or ask for less",
        )
    ]
    await svc.quotas_changed(QuotasChangedInput(quotas=[]))
    await svc.outbox.idle()
    assert placements(cluster)[-1] == ("job/default/a", "w-0", "n0", "")


async def test_the_catalogue_of_drives_is_read_back_and_changes_decide_again_and_its_users_are_known() -> None:
    drive = Drive(name="imagenet", size_bytes=2**30, node="n1", source="/srv/imagenet")
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=1)}, drives=[drive])
    svc = await service(cluster)
    await place(svc, request(run="reader", drives=("imagenet",)))
    await place(svc, request(run="other", drives=("llama",)))
    assert placements(cluster) == [
        ("job/default/reader", "w-0", None, "Choose where to keep data on n0"),
        ("job/default/other", "w-0", None, "No machine fits: 1 of 1 machines ready"),
    ]
    users = await svc.drive_users(RemoveDriveRequest(name="imagenet"))
    assert users.runs == ["default/reader"]
    await svc.drives_changed(DrivesChangedInput(drives=[drive, drive.model_copy(update={"name": "llama"})]))
    await svc.outbox.idle()
    assert placements(cluster)[-1] == ("job/default/other", "w-0", None, "Choose where to keep data on n0")
    assert (await svc.drive_users(RemoveDriveRequest(name="nothing"))).runs == []


async def test_a_run_that_is_gone_is_forgotten_when_it_is_told_something() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=1)})
    svc = await service(cluster)
    await place(svc, request(gpus=1))
    cluster.gone.add("job/default/a")  # terminated without giving its room back
    await place(svc, request(run="urgent", priority=5, gpus=1))  # preempting a finds it gone
    await svc.outbox.idle()
    assert placements(cluster)[-1] == ("job/default/urgent", "w-0", "n0", "")


async def test_a_sweep_forgets_runs_that_closed_without_giving_their_room_back() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=1)})
    svc = await service(cluster)
    await place(svc, request(gpus=1))
    await place(svc, request(run="b", gpus=1))
    assert placements(cluster)[-1][3] == "Next to run (priority 0): waits for running work to end"
    cluster.runs["job/default/b"] = (0, _view("b", [request(run="b", gpus=1)], []))  # b is listed as open
    cluster.gone.add("job/default/a")  # a is not listed: terminated
    await svc.sweep()
    await svc.outbox.idle()
    assert placements(cluster)[-1] == ("job/default/b", "w-0", "n0", "")


async def test_a_removed_machine_is_forgotten() -> None:
    from workflows.domain.inventory import NodeState

    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    await svc.node_changed(NodeChangedInput(node=machine("n0", gpus=8, state=NodeState.REMOVED)))
    await svc.outbox.idle()
    await place(svc, request(gpus=1))
    assert placements(cluster)[-1][3] == "No machine fits: 0 of 0 machines ready: no machines are registered"


async def test_a_cordoned_machine_takes_nothing_new() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    await svc.node_changed(NodeChangedInput(node=machine("n0", gpus=8, cordon="repairs")))
    await svc.outbox.idle()
    await place(svc, request(gpus=1))
    [(_, update)] = cluster.sent("placement")
    assert (update.reason, update.nodes[0].reasons) == (
        Reason("NoMachineFits", "No machine fits: 1 of 1 machines ready"),
        [Reason("Cordoned", "machine is cordoned: repairs")],
    )


def _view(job: str, pending: list[TaskRequest], placed: list[Allocation]) -> SchedulerView:
    return SchedulerView(job_id=f"job/default/{job}", namespace="default", pending=pending, placed=placed)


async def test_a_rebuilt_service_reads_priorities_and_quotas_and_decides_the_same() -> None:
    running = holding("n0", run="low", task="w-0", gpus=8).model_copy(update={"priority": 0, "started_at": None})
    cluster = FakeCluster(
        nodes={"n0": machine("n0", gpus=8), "n1": machine("n1", gpus=4)},
        runs={
            "job/default/low": (0, _view("low", [], [running])),
            "job/default/mid": (5, _view("mid", [request(run="mid", priority=5, gpus=8)], [])),
            "job/capped/c": (
                9,
                SchedulerView(
                    job_id="job/capped/c",
                    namespace="capped",
                    pending=[request(run="c", namespace="capped", priority=9, gpus=4)],
                ),
            ),
        },
        quotas=[Quota(namespace="capped", gpus=2)],
    )
    await service(cluster)
    first = list(cluster.signals)
    said = [
        (job, m.reason.text if isinstance(m, PlacementUpdate) and m.reason else getattr(m, "by", ""))
        for job, _, m in first
    ]
    assert sorted(said) == [
        (
            "job/capped/c",
            "Waits for more than the namespace's quota allows at all (gpus 4 asked > 2): raise the "
            "quota or ask for less",
        ),
        ("job/default/low", "mid"),
        ("job/default/mid", "Preempting 1 lower-priority worker(s) of low to start"),
    ]
    cluster.signals.clear()
    await service(cluster)  # a second scheduler after a kill -9 (nothing changed in the runs meanwhile)
    assert cluster.signals == first


async def test_planning_a_group_uses_the_view() -> None:
    cluster = FakeCluster(nodes={f"n{i}": machine(f"n{i}", gpus=8) for i in range(3)})
    svc = await service(cluster)
    plan = await svc.plan_group(PlanInput(request=request(group="train"), total_gpus=16))
    assert (plan.workers, plan.gpus_per_worker) == (2, 8)
    plan = await svc.plan_group(PlanInput(request=request(group="train"), total_gpus=32))
    assert plan.reason == "Cannot plan workers: no way to run 32 GPUs on these machines: 8 free on the largest one now"


@pytest.mark.parametrize("attempt", [0, 1])
async def test_release_of_an_old_attempt_does_not_free_a_newer_one(attempt: int) -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    await place(svc, request(gpus=8).model_copy(update={"attempt": 1}))
    await svc.release(ReleaseInput(job_id="job/default/a", task_id="w-0", attempt=attempt))
    await svc.outbox.idle()
    await place(svc, request(run="b", gpus=8))
    expected = "n0" if attempt == 1 else None
    assert placements(cluster)[-1][2] == expected


class CountingService(SchedulerService):
    passes = 0

    def _pass(self) -> None:
        self.passes += 1
        super()._pass()


class SlowHandle(_Handle):
    async def signal(self, name: str, message: BaseModel) -> None:
        await asyncio.sleep(0.01)  # signals take a while: changes pile up behind the pass in progress
        await super().signal(name, message)


class SlowClient(FakeClient):
    def get_workflow_handle(self, workflow_id: str) -> _Handle:
        return SlowHandle(self.cluster, workflow_id)


async def test_changes_that_arrive_during_a_pass_are_decided_together() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", cpus=64, gpus=64)})
    svc = CountingService(SlowClient(cluster), Clock())  # type: ignore[arg-type]
    await svc.rebuild()
    svc.passes = 0
    await asyncio.gather(*(place(svc, request(run=f"r{i}", gpus=1)) for i in range(20)))
    assert sorted(job for job, _, node, _ in placements(cluster) if node == "n0") == sorted(
        f"job/default/r{i}" for i in range(20)
    )
    assert svc.passes <= 3


async def test_a_placed_worker_is_told_its_machines_address_and_every_gang_member_is_answered() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8, address="10.0.0.5"), "n1": machine("n1", gpus=8)})
    svc = await service(cluster)
    members = [request(f"w-{i}", run="g", gpus=8, gang=True) for i in range(2)]
    await place(svc, *members)
    assert sorted((job, u.task_id, u.node, u.address) for job, u in cluster.sent("placement")) == [
        ("job/default/g", "w-0", "n0", "10.0.0.5"),
        ("job/default/g", "w-1", "n1", "127.0.0.1"),
    ]
    await place(svc, members[0])  # asked again: the same answer, address included
    assert cluster.sent("placement")[-1][1] == PlacementUpdate(task_id="w-0", attempt=0, node="n0", address="10.0.0.5")


async def test_a_gang_that_cannot_be_placed_whole_answers_every_member() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)})
    svc = await service(cluster)
    await place(svc, *(request(f"w-{i}", run="g", gpus=8, gang=True) for i in range(2)))
    assert placements(cluster) == [
        ("job/default/g", "w-0", None, "Gang cannot be placed whole: 1 of 1 machines ready"),
        ("job/default/g", "w-1", None, "Gang cannot be placed whole: 1 of 1 machines ready"),
    ]


async def test_a_worker_waiting_on_quota_is_told_what_its_run_records() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8)}, quotas=[Quota(namespace="default", gpus=4)])
    svc = await service(cluster)
    await place(svc, request(run="first", gpus=2))
    assert cluster.sent("placement")[-1][1].quota_reached is None
    await place(svc, *(request(f"w-{i}", run="g", gpus=2, gang=True) for i in range(2)))
    answers = [u for _, u in cluster.sent("placement")[1:]]
    assert [(u.task_id, u.reason, u.quota_reached) for u in answers] == [
        (
            f"w-{i}",
            Reason("GangWaitsForQuota", "Gang waits for namespace quota: gpus 2 in use + 4 asked > 4"),
            Reason("QuotaReached", "Quota reached: gpus 2 in use + 4 asked > 4"),
        )
        for i in range(2)
    ]


async def test_a_lost_machine_is_told_to_every_run_holding_room_on_it() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=2), "n1": machine("n1", gpus=2)})
    svc = await service(cluster)
    await place(svc, request(run="a", gpus=2))
    await place(svc, request(run="b", gpus=2))
    await place(svc, request(run="c", gpus=1))  # waits: told nothing about n0
    on_n0 = next(job for job, _, node, _ in placements(cluster) if node == "n0")
    assert await svc.tell_runs_machine_lost(MachineLost(node="n0")) == 1
    assert cluster.sent("machine_lost") == [(on_n0, MachineLost(node="n0"))]


async def test_a_lost_machine_is_told_with_when_it_was_lost() -> None:
    """The run needs the time of the loss to tell it from a start by the machine's next agent (chaos run-0019)."""
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=2)})
    svc = await service(cluster)
    await place(svc, request(run="a", gpus=2))
    report = MachineLost(node="n0", lost_at=datetime(2025, 1, 1, 3, 41, 17, tzinfo=UTC))
    assert await svc.tell_runs_machine_lost(report) == 1
    assert cluster.sent("machine_lost") == [("job/default/a", report)]
    assert cluster.sent("machine_lost")[0][1].lost_at == datetime(2025, 1, 1, 3, 41, 17, tzinfo=UTC)


async def test_a_run_placed_at_once_is_answered_in_the_call_and_not_signalled() -> None:
    cluster = FakeCluster(nodes={"n0": machine("n0", gpus=8, address="10.0.0.5")})
    svc = await service(cluster)
    result = await svc.place(PlaceInput(requests=[request(gpus=2), request("w-1", gpus=64)]))
    await svc.outbox.idle()
    assert [(a.task_id, a.node, a.address, a.reason) for a in result.answers] == [
        ("w-0", "n0", "10.0.0.5", None),
        ("w-1", None, None, Reason("NoMachineFits", "No machine fits: 1 of 1 machines ready")),
    ]
    assert cluster.signals == []
