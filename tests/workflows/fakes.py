"""Activities under the real names for workflow tests in virtual time: a scheduler that places every worker on
machine n0 at once, and an agent whose workers end as each test scripts them (the real ones are tested against
real processes in tests/integration)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from activities.control import ControlActivities
from workflows.contracts import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, node_task_queue
from workflows.domain.inventory import NodeView
from workflows.domain.reasons import Reason
from workflows.domain.run.events import MachineHeard, MachineLost, PlacementUpdate, TaskHealth, TaskRunning
from workflows.domain.run.job import first_requests
from workflows.domain.scheduling.planning import TaskPlan
from workflows.domain.settings import Settings
from workflows.domain.spec import job_id
from workflows.job import JobWorkflow
from workflows.messages import (
    PROTOCOL,
    LeaseInput,
    LoadSettingsInput,
    LoadSettingsResult,
    NodeChangedInput,
    PlaceInput,
    PlaceResult,
    PlanInput,
    ReleaseInput,
    RunTaskInput,
    StartTaskInput,
    StartTaskResult,
    StopTaskInput,
    SuperviseInput,
    TaskExit,
)
from workflows.node import NodeWorkflow

NODE = "n0"


@dataclass
class Script:
    """How each worker ends: exit codes by task id, in order of attempts (the last one repeats)."""

    exits: dict[str, list[int]] = field(default_factory=dict)
    log_tail: str = ""
    hold: set[str] = field(default_factory=set)  # these run until stopped: "w-0" (every attempt) or "w-0.1"
    hold_exit: int = 143  # how a held worker exits once stopped (0: it ended on its own)
    no_room: set[str] = field(default_factory=set)  # these never fit
    machines: dict[str, str] = field(default_factory=dict)  # these are placed on another machine than n0
    # Supervisors that go silent (no heartbeat) before one answers again: "w-0.0" -> how many go silent
    # (a large number: the agent never answers again).
    silent: dict[str, int] = field(default_factory=dict)
    # Gang members whose set-up ("w-1", or one attempt "w-1.0") never finishes: each barrier call fails, and is
    # tried again, so virtual time still runs.
    late: set[str] = field(default_factory=set)
    plans: list[TaskPlan] = field(default_factory=list)  # plan_group answers, in order (the last repeats)
    stop_seconds: float = 0  # how long a stop takes (real seconds, heartbeating): long enough to be cancelled
    place_apart: bool = False  # load_settings places no worker: the run calls `place` (histories before it did)
    admit_also: str | None = None  # load_settings also asks for this worker, which the run never asks for
    settings_seconds: float = 0  # how long load_settings takes (real seconds): long enough to outlast a workflow task
    healthy: set[str] = field(default_factory=set)  # these pass their readiness check once running
    # Workers that end only once another has reported Running: "w-0" -> "w-1" (its report is then in the run's
    # history before the exit, whatever the machine's load)
    after: dict[str, str] = field(default_factory=dict)

    def holds(self, task_id: str, attempt: int) -> bool:
        return task_id in self.hold or f"{task_id}.{attempt}" in self.hold


class FakeCluster:
    def __init__(self, client: Client, settings: Settings, script: Script, protocol: int = PROTOCOL) -> None:
        self.client = client
        self.settings = settings
        self.protocol = protocol  # the protocol new runs are created with
        self.script = script
        self.released: list[tuple[str, int]] = []
        self.placed: list[list[str]] = []  # the workers of each place call, in order
        self.stopped: dict[str, asyncio.Event] = {}
        self.supervisors: list[tuple[str, int, bool]] = []  # (task, attempt, reattach) of every call
        self.starts: list[StartTaskInput] = []
        self.planned: list[PlanInput] = []  # every start_task call that answered, in order
        self.stops_cancelled: list[str] = []  # stops whose activity was cancelled ("w-0.0")
        self.reported: dict[str, asyncio.Event] = {}  # workers whose task_running signal the server has

    def control_side(self) -> list[Any]:
        """The control plane's activities: place and release are the local activities of protocol 3 (the scheduler's
        queue serves older runs'); the real cancel_run_workflow only asks Temporal to cancel a run."""
        control = ControlActivities(self.settings, self.client)
        return [self.load_settings, control.cancel_run_workflow, self.place, self.release]

    def machine_side(self) -> list[Any]:
        """n0's agent's activities."""
        return [self.start_task, self.run_task, self.supervise_task, self.stop_task]

    @activity.defn(name="load_settings")
    async def load_settings(self, input: LoadSettingsInput | None = None) -> LoadSettingsResult:
        """With a new run's spec, its first requests placed as the real control plane does (by this fake `place`),
        unless the script asks that the run call `place` itself, as runs of older histories do."""
        await asyncio.sleep(self.script.settings_seconds)
        loaded = LoadSettingsResult(settings=self.settings, protocol=self.protocol, at=input.at if input else None)
        if input is None or self.script.place_apart:
            return loaded
        requests = first_requests(input.spec, self.settings, self.protocol, input.at)
        if not requests:
            return loaded
        if self.script.admit_also is not None:
            requests.append(requests[0].model_copy(update={"task_id": self.script.admit_also}))
        placed = await self.place(PlaceInput(requests=requests))
        return loaded.model_copy(update={"requests": requests, "answers": placed.answers})

    @activity.defn(name="place")
    async def place(self, input: PlaceInput) -> PlaceResult:
        """Answers in its result, as the real scheduler does for what it decides at once."""
        self.placed.append([r.task_id for r in input.requests])
        answers = []
        for r in input.requests:
            if r.task_id in self.script.no_room:
                update = PlacementUpdate(
                    task_id=r.task_id,
                    attempt=r.attempt,
                    reason=Reason("NoMachineFits", "No machine fits: 1 of 1 machines ready"),
                )
            else:
                node = self.script.machines.get(r.task_id, NODE)
                update = PlacementUpdate(task_id=r.task_id, attempt=r.attempt, node=node, address="127.0.0.1")
            answers.append(update)
        return PlaceResult(answers=answers)

    @activity.defn(name="plan_workers")
    async def plan_group(self, input: PlanInput) -> TaskPlan:
        self.planned.append(input)
        return self.script.plans[min(len(self.planned), len(self.script.plans)) - 1]

    @activity.defn(name="release")
    async def release(self, input: ReleaseInput) -> None:
        self.released.append((input.task_id, input.attempt))

    @activity.defn(name="start_task")
    async def start_task(self, input: StartTaskInput) -> StartTaskResult:
        ref = input.ref
        stopped = self.stopped.get(f"{ref.task_id}.{ref.attempt}")
        if stopped is not None and stopped.is_set():
            raise ApplicationError("Stopped on request", type="StoppedOnRequest", non_retryable=True)
        if input.barrier and (ref.task_id in self.script.late or f"{ref.task_id}.{ref.attempt}" in self.script.late):
            raise ApplicationError("still pulling")  # retried (PATIENT) until the run gives up on it
        self.starts.append(input)
        # Picked up when this activity started (the server's clock, virtual in these tests), as the agent says.
        return StartTaskResult(started=not input.barrier, picked_up_at=activity.info().started_time)

    @activity.defn(name="run_task")
    async def run_task(self, input: RunTaskInput) -> TaskExit:
        """start_task then supervise_task in one call, as the real agent does."""
        picked_up = activity.info().started_time
        await self.start_task(input.start)
        supervised = SuperviseInput(ref=input.start.ref, settings=input.settings, readiness=input.readiness)
        return await self._supervise(supervised, started=True, picked_up=picked_up)

    @activity.defn(name="supervise_task")
    async def supervise_task(self, input: SuperviseInput) -> TaskExit:
        return await self._supervise(input, started=False)

    async def _supervise(self, input: SuperviseInput, started: bool, picked_up: datetime | None = None) -> TaskExit:
        ref = input.ref
        key = f"{ref.task_id}.{ref.attempt}"
        self.supervisors.append((ref.task_id, ref.attempt, input.reattach))
        handle = self.client.get_workflow_handle(job_id(ref.namespace, ref.job))
        report = TaskRunning(
            **ref.ids(), heartbeat=input.reattach, started=started, picked_up_at=picked_up, started_at=picked_up
        )
        if self.script.silent.get(key, 0) > 0:
            self.script.silent[key] -= 1
            if not input.reattach:
                await handle.signal("task_running", report)
            await asyncio.sleep(3600)  # no heartbeat: the workflow's heartbeat timeout ends this call
        await handle.signal("task_running", report)
        self.reported.setdefault(ref.task_id, asyncio.Event()).set()
        if input.readiness is not None:
            healthy = ref.task_id in self.script.healthy
            health = TaskHealth(task_id=ref.task_id, attempt=ref.attempt, healthy=healthy)
            await handle.signal("task_health", health)
        if self.script.holds(ref.task_id, ref.attempt):
            stopped = self.stopped.setdefault(f"{ref.task_id}.{ref.attempt}", asyncio.Event())
            while not stopped.is_set():
                activity.heartbeat()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopped.wait(), 0.2)
            return TaskExit(exit_code=self.script.hold_exit)
        if ref.task_id in self.script.after:
            await self.reported.setdefault(self.script.after[ref.task_id], asyncio.Event()).wait()
        codes = self.script.exits.get(ref.task_id, [0])
        return TaskExit(exit_code=codes[min(ref.attempt, len(codes) - 1)], log_tail=self.script.log_tail)

    @activity.defn(name="stop_task")
    async def stop_task(self, input: StopTaskInput) -> None:
        key = f"{input.ref.task_id}.{input.ref.attempt}"
        deadline = asyncio.get_running_loop().time() + self.script.stop_seconds
        try:
            while asyncio.get_running_loop().time() < deadline:
                activity.heartbeat()  # how a cancellation of the activity would reach it
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.stops_cancelled.append(key)
            raise
        self.stopped.setdefault(key, asyncio.Event()).set()


@contextlib.asynccontextmanager
async def fake_cluster(
    client: Client, script: Script, settings: Settings | None = None, protocol: int = PROTOCOL
) -> AsyncIterator[FakeCluster]:
    """Workers for the control, scheduler and n0 task queues, serving the fakes (new runs get `protocol`)."""
    cluster = FakeCluster(client, settings or Settings(), script, protocol)
    workers = [
        Worker(
            client,
            task_queue=CONTROL_TASK_QUEUE,
            workflows=[JobWorkflow, NodeWorkflow],
            activities=cluster.control_side(),
        ),
        Worker(
            client, task_queue=SCHEDULER_TASK_QUEUE, activities=[cluster.place, cluster.release, cluster.plan_group]
        ),
        Worker(client, task_queue=node_task_queue(NODE), activities=cluster.machine_side()),
    ]
    async with contextlib.AsyncExitStack() as stack:
        for worker in workers:
            await stack.enter_async_context(worker)
        yield cluster


def unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def pairs(entries: Iterable[Any]) -> list[tuple[str, str]]:
    """(state, reason) of each entry of a history."""
    return [(e.state, e.reason) for e in entries]


class FakeMachine:
    """A machine's agent (its lease) and the scheduler's side of NodeWorkflow: what it is told of the machine."""

    def __init__(self, name: str | None = None) -> None:
        self.name = name  # the machine whose changes it hears (None: every machine's)
        self.alive = True
        self.seen: list[NodeView] = []
        self.lost: list[MachineLost] = []
        self.heard: list[MachineHeard] = []
        self.told: list[str] = []  # what its runs were told, in order: "late", "back", "new agent", "lost"

    @activity.defn(name="hold_lease")
    async def hold_lease(self, input: LeaseInput) -> None:
        while self.alive:  # a dead agent stops heartbeating
            activity.heartbeat()
            await asyncio.sleep(input.renew_seconds)
        await asyncio.sleep(30)

    @activity.defn(name="machine_lost")
    async def tell_runs_machine_lost(self, report: MachineLost) -> int:
        if self.name is None or report.node == self.name:
            self.lost.append(report)
            self.told.append("lost")
        return 0

    def scheduler_side(self) -> list[Any]:
        """The scheduler's activities a machine's workflow calls."""
        return [self.node_changed, self.tell_runs_machine_lost, self.tell_runs_machine_heard]

    @activity.defn(name="machine_heard")
    async def tell_runs_machine_heard(self, report: MachineHeard) -> int:
        if self.name is None or report.node == self.name:
            self.heard.append(report)
            self.told.append("late" if report.late else "new agent" if report.new_agent else "back")
        return 0

    @activity.defn(name="node_changed")
    async def node_changed(self, input: NodeChangedInput) -> None:
        if self.name is None or input.node.name == self.name:  # the queue is shared with other tests' machines
            self.seen.append(input.node)


@contextlib.asynccontextmanager
async def machine_workflow(
    client: Client, machine: FakeMachine, inventory: Any, settings: Settings
) -> AsyncIterator[Any]:
    """A machine's workflow, registered by `machine` (its agent's lease, and the scheduler's side it is told on):
    the control plane's, the scheduler's and the machine's workers, and the workflow's handle."""
    from workflows.contracts import node_id
    from workflows.domain.machine.decisions import Registered
    from workflows.messages import NodeInput
    from workflows.node import NodeWorkflow

    name = inventory.name
    async with (
        Worker(client, task_queue=CONTROL_TASK_QUEUE, workflows=[NodeWorkflow]),
        Worker(client, task_queue=SCHEDULER_TASK_QUEUE, activities=machine.scheduler_side()),
        Worker(client, task_queue=node_task_queue(name), activities=[machine.hold_lease]),
    ):
        handle = await client.start_workflow(
            NodeWorkflow.run, NodeInput(name=name, settings=settings), id=node_id(name), task_queue=CONTROL_TASK_QUEUE
        )
        await handle.execute_update(NodeWorkflow.register, Registered(inventory=inventory))
        yield handle
