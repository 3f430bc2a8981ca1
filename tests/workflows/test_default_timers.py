"""The spec's liveness defaults, unshrunk, on the time-skipping test server with `Settings()` as shipped. Since protocol
7 its machine's lease carries a worker's liveness: a machine unheard for 15 s of grace has its running workers Stale,
and at its 30 s TTL it is lost, and they are Down. Before, each watch had a heartbeat of its own: a worker unheard for
15 s of grace was Stale, and Down once its 60 s TTL had passed.

The test server skips time only while no activity is in flight, and a missed heartbeat needs one: the grace passes
in real time (15 s). The TTL passes in virtual time: the machine's agent fails each later watch at once (its runtime
does not answer), and the run waits a second between watches, with nothing in flight. (The test server keeps time
locked for the activity whose heartbeat it timed out, as measured here: the test releases that one lock.)"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any, NoReturn

from temporalio import activity
from temporalio.api.testservice.v1 import UnlockTimeSkippingRequest
from temporalio.client import WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflows.fakes import NODE, FakeCluster, FakeMachine, Script, pairs, unique
from tests.workflows.test_liveness import start
from workers.outcomes import run_result
from workflows.contracts import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, node_id, node_task_queue
from workflows.domain.inventory import NodeInventory
from workflows.domain.machine.decisions import Registered
from workflows.domain.run.events import MachineHeard, MachineLost, TaskRunning
from workflows.domain.run.status import Status
from workflows.domain.run.views import JobDescription
from workflows.domain.settings import Settings
from workflows.domain.spec import job_id, parse_spec
from workflows.job import JobWorkflow
from workflows.messages import NodeInput, RunTaskInput, SuperviseInput, TaskExit
from workflows.node import NodeWorkflow


class SilentAgent:
    """A machine's agent that starts the worker and reports it running, then goes silent: that watch never
    heartbeats again (it is left to complete asynchronously, so nothing of it runs here), and every later watch
    fails at once, its runtime not answering."""

    def __init__(self, env: WorkflowEnvironment) -> None:
        self.env = env
        self.watches = 0

    @activity.defn(name="run_task")
    async def run_task(self, input: RunTaskInput) -> TaskExit:
        ref = input.start.ref
        report = TaskRunning(**ref.ids(), heartbeat=False, started=True)
        await self.env.client.get_workflow_handle(job_id(ref.namespace, ref.job)).signal("task_running", report)
        activity.raise_complete_async()  # in flight, and never heartbeating again

    @activity.defn(name="supervise_task")
    async def supervise_task(self, input: SuperviseInput) -> NoReturn:
        self.watches += 1
        raise ApplicationError("the Docker engine does not answer", type="RuntimeUnavailable")


async def until_stale(handle: WorkflowHandle[Any, Any]) -> None:
    for _ in range(400):  # the grace is real time here: 15 s
        described = await handle.query("describe", result_type=JobDescription)
        if described.tasks and described.tasks[0].status.state == "Stale":
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"never Stale: {described.tasks[0].history if described.tasks else described.status}")


async def test_a_silent_worker_is_stale_after_15_s_and_down_after_its_60_s_ttl(
    own_time_skipping: WorkflowEnvironment,
) -> None:
    env = own_time_skipping
    settings = Settings()
    assert (settings.stale_grace_seconds, settings.heartbeat_ttl_seconds) == (15, 60)  # the spec's defaults
    job = parse_spec(
        {"name": unique("defaults"), "groups": [{"name": "w", "command": ["x"], "restart_policy": "Never"}]}
    )
    # loads the settings, places on n0 at once, releases; a run from before protocol 7
    control = FakeCluster(env.client, settings, Script(), protocol=6)
    agent = SilentAgent(env)
    control_worker = Worker(
        env.client, task_queue=CONTROL_TASK_QUEUE, workflows=[JobWorkflow], activities=control.control_side()
    )
    node_worker = Worker(
        env.client, task_queue=node_task_queue(NODE), activities=[agent.run_task, agent.supervise_task]
    )
    async with control_worker, node_worker:
        handle = await start(env, job)
        await until_stale(handle)
        await env.client.test_service.unlock_time_skipping(UnlockTimeSkippingRequest())
        status = await asyncio.wait_for(run_result(handle), timeout=90)  # some 60 watches, each a round trip
        described = await handle.query("describe", result_type=JobDescription)

    history = described.tasks[0].history
    assert pairs(history)[-3:] == [
        ("Running", "Container running"),
        ("Stale", "Heartbeat lease expired"),
        ("Down", "No heartbeat for the worker's full TTL after going stale"),
    ]
    running, stale, down = (entry.at for entry in history[-3:])
    # The grace counts from the watch's start, just before it reported the worker running; each mark is when the
    # workflow task that saw it started, a little later on a loaded machine (2 s allowed: CI's 2 cores).
    assert timedelta(seconds=14) < stale - running < timedelta(seconds=17), history
    assert timedelta(seconds=60) <= down - stale < timedelta(seconds=62), history
    assert agent.watches >= 50  # watched again every second of the TTL, in vain
    assert (status.state, status.reason) == (
        "Failed",
        "Worker w-0 was lost on n0: No heartbeat for the worker's full TTL after going stale",
    )


class Scheduler(FakeMachine):
    """The scheduler's side of the machine's workflow, telling n0's run what the machine's workflow says."""

    def __init__(self, env: WorkflowEnvironment, run: str) -> None:
        super().__init__(NODE)
        self.env, self.run = env, run

    @activity.defn(name="machine_heard")
    async def tell_runs_machine_heard(self, report: MachineHeard) -> int:
        await super().tell_runs_machine_heard(report)
        await self.env.client.get_workflow_handle(self.run).signal("machine_heard", report)
        return 1

    @activity.defn(name="machine_lost")
    async def tell_runs_machine_lost(self, report: MachineLost) -> int:
        await super().tell_runs_machine_lost(report)
        await self.env.client.get_workflow_handle(self.run).signal("machine_lost", report)
        return 1


async def test_a_silent_machine_has_its_workers_stale_after_15_s_and_down_at_its_30_s_lease(
    own_time_skipping: WorkflowEnvironment,
) -> None:
    env = own_time_skipping
    settings = Settings()
    assert (settings.stale_grace_seconds, settings.node_lease_ttl_seconds) == (15, 30)  # the spec's defaults
    job = parse_spec({"name": unique("silent"), "groups": [{"name": "w", "command": ["x"], "restart_policy": "Never"}]})
    control = FakeCluster(env.client, settings, Script(hold={"w-0"}))  # places on n0, runs w-0 until stopped
    scheduler = Scheduler(env, job.job_id)
    inventory = NodeInventory(name=NODE, cpus=8, memory_bytes=2**34)
    async with (
        Worker(
            env.client,
            task_queue=CONTROL_TASK_QUEUE,
            workflows=[JobWorkflow, NodeWorkflow],
            activities=control.control_side(),
        ),
        Worker(env.client, task_queue=SCHEDULER_TASK_QUEUE, activities=scheduler.scheduler_side()),
        Worker(
            env.client, task_queue=node_task_queue(NODE), activities=[*control.machine_side(), scheduler.hold_lease]
        ),
    ):
        node = await env.client.start_workflow(
            NodeWorkflow.run, NodeInput(name=NODE, settings=settings), id=node_id(NODE), task_queue=CONTROL_TASK_QUEUE
        )
        await node.execute_update(NodeWorkflow.register, Registered(inventory=inventory))
        handle = await start(env, job)
        while (await handle.query("status", result_type=Status)).state != "Running":
            await asyncio.sleep(0.1)
        scheduler.alive = False  # the machine's agent stops renewing: its worker's watch says nothing either
        status = await asyncio.wait_for(run_result(handle), timeout=60)
        described = await handle.query("describe", result_type=JobDescription)
        machine = await node.query(NodeWorkflow.view)

    history = described.tasks[0].history
    assert pairs(history)[-3:] == [
        ("Running", "Container running"),
        ("Stale", "Heartbeat lease expired"),
        ("Down", "Machine lost: its lease expired"),
    ]
    running, stale, down = (entry.at for entry in history[-3:])
    # The lease's last renewal came within 5 s (a third of the grace) before the silence; each mark is when the
    # workflow task that saw it started, a little later on a loaded machine (2 s allowed: CI's 2 cores).
    assert timedelta(seconds=10) < stale - running < timedelta(seconds=17), history
    assert timedelta(seconds=15) <= down - stale < timedelta(seconds=17), history
    assert scheduler.told == ["late", "lost"]
    assert machine.state == "Down"
    assert (status.state, status.reason) == ("Failed", "Worker w-0 was lost on n0: Machine lost: its lease expired")
