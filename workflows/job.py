"""JobWorkflow: one run, durable. It turns messages into domain events and carries out the core's commands."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import ActivityError, ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows.domain import job as core
    from workflows.domain.nodes import node_task_queue
    from workflows.domain.reasons import R
    from workflows.domain.settings import Settings
    from workflows.domain.spec import JobSpec
    from workflows.domain.status import RUN_TERMINAL, TASK_ENDED, JobRecord, Status, TaskState
    from workflows.domain.views import Event, JobDescription, describe, events
    from workflows.messages import (
        SA_NAMESPACE,
        SA_PRIORITY,
        SA_STATE,
        SCHEDULER_TASK_QUEUE,
        JobInput,
        PlaceInput,
        ReleaseInput,
        SchedulerView,
        StartTaskInput,
        StartTaskResult,
        StopTaskInput,
        StopTaskRequest,
        SuperviseInput,
        TaskExit,
        TaskProgressReport,
        TaskRef,
        TaskReport,
    )

STATE_KEY = SearchAttributeKey.for_keyword(SA_STATE)
NAMESPACE_KEY = SearchAttributeKey.for_keyword(SA_NAMESPACE)
PRIORITY_KEY = SearchAttributeKey.for_int(SA_PRIORITY)

# The scheduler and agents come back after a crash: keep retrying calls to them, gently.
PATIENT = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
ONCE = RetryPolicy(maximum_attempts=1)


def search_attributes(spec: JobSpec, state: str) -> TypedSearchAttributes:
    """The run's listable attributes (set at start by the client, kept current by the workflow)."""
    return TypedSearchAttributes(
        [
            SearchAttributePair(NAMESPACE_KEY, spec.namespace),
            SearchAttributePair(STATE_KEY, state),
            SearchAttributePair(PRIORITY_KEY, spec.priority),
        ]
    )


@workflow.defn(name="JobWorkflow")
class JobWorkflow:
    def __init__(self) -> None:
        self._job: JobRecord | None = None
        self._inbox: list[core.Event] = []
        self._effects: set[asyncio.Task[None]] = set()

    # ---- run --------------------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: JobInput) -> Status:
        if input.record is not None:
            raise ApplicationError("continuing a run as new is not built yet", non_retryable=True)
        settings = await workflow.execute_local_activity(
            "load_settings", result_type=Settings, start_to_close_timeout=timedelta(seconds=10)
        )
        self._job = core.new_job(input.spec, settings, workflow.now())
        self._inbox.append(core.Created())
        while True:
            await workflow.wait_condition(lambda: bool(self._inbox) or self._settled())
            if not self._inbox:
                break
            events_, self._inbox = self._inbox, []
            self._job, commands = core.decide(self._job, events_, workflow.now())
            for command in commands:
                self._carry_out(command)
            self._publish()
        return self._job.status

    def _settled(self) -> bool:
        # Close only once the run ended and every effect (releases included) finished.
        return self._job is not None and core.is_settled(self._job) and not self._effects

    def _publish(self) -> None:
        assert self._job is not None
        status = self._job.status
        workflow.upsert_search_attributes([STATE_KEY.value_set(status.state)])
        workflow.set_current_details(f"**{status.state}**: {status.reason}")

    # ---- commands ---------------------------------------------------------------------------------------------

    def _carry_out(self, command: core.Command) -> None:
        match command:
            case core.Place():
                self._spawn(self._place(command))
            case core.Release():
                self._spawn(self._release(command))
            case core.Start():
                self._spawn(self._start(command))
            case core.Stop():
                self._spawn(self._stop(command))
            case core.ArmRestart():
                self._spawn(self._restart_timer(command))

    def _spawn(self, effect: Awaitable[None]) -> None:
        task = asyncio.ensure_future(effect)
        self._effects.add(task)
        task.add_done_callback(self._effects.discard)

    def _ref(self, task_id: str, attempt: int) -> TaskRef:
        assert self._job is not None
        spec = self._job.spec
        return TaskRef(namespace=spec.namespace, job=spec.name, task_id=task_id, attempt=attempt)

    async def _place(self, command: core.Place) -> None:
        await workflow.execute_activity(
            "place",
            PlaceInput(requests=command.requests),
            task_queue=SCHEDULER_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=PATIENT,
            summary=f"place {', '.join(r.task_id for r in command.requests)}",
        )

    async def _release(self, command: core.Release) -> None:
        assert self._job is not None
        await workflow.execute_activity(
            "release",
            ReleaseInput(job_id=self._job.id, task_id=command.task_id, attempt=command.attempt),
            task_queue=SCHEDULER_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=PATIENT,
            summary=f"release {command.task_id}",
        )

    async def _start(self, command: core.Start) -> None:
        """Start the worker on its machine, then watch it until it ends."""
        assert self._job is not None
        ref = self._ref(command.task_id, command.attempt)
        queue = node_task_queue(command.node)
        try:
            await workflow.execute_activity(
                "start_task",
                StartTaskInput(ref=ref, group=command.group),
                task_queue=queue,
                result_type=StartTaskResult,
                start_to_close_timeout=timedelta(minutes=2),
                retry_policy=PATIENT,
                summary=f"start {command.task_id} on {command.node}",
            )
        except ActivityError as error:
            code, reason = _failure(error)
            self._inbox.append(core.TaskSetupFailed(**_ids(command), code=code, reason=reason))
            return
        self._inbox.append(core.TaskStarted(**_ids(command)))
        result = await workflow.execute_activity(
            "supervise_task",
            SuperviseInput(ref=ref, settings=self._job.settings),
            task_queue=queue,
            result_type=TaskExit,
            start_to_close_timeout=timedelta(days=3650),
            heartbeat_timeout=timedelta(seconds=self._job.settings.node_lease_ttl_seconds),
            retry_policy=PATIENT,
            summary=f"supervise {command.task_id} on {command.node}",
        )
        self._inbox.append(core.TaskEnded(**_ids(command), **result.model_dump()))

    async def _stop(self, command: core.Stop) -> None:
        assert self._job is not None
        grace = self._job.settings.stop_grace_seconds
        await workflow.execute_activity(
            "stop_task",
            StopTaskInput(ref=self._ref(command.task_id, command.attempt), grace_seconds=grace),
            task_queue=node_task_queue(command.node),
            start_to_close_timeout=timedelta(seconds=grace + 60),
            heartbeat_timeout=timedelta(seconds=30),
            retry_policy=PATIENT,
            summary=f"stop {command.task_id} on {command.node}",
        )

    async def _restart_timer(self, command: core.ArmRestart) -> None:
        await workflow.sleep(max((command.at - workflow.now()).total_seconds(), 0), summary="restart back-off")
        self._inbox.append(core.RestartDue(task_id=command.task_id, attempt=command.attempt))

    # ---- messages ---------------------------------------------------------------------------------------------

    @workflow.signal(name="placement")
    def placement(self, update: core.PlacementUpdate) -> None:
        self._inbox.append(update)

    @workflow.signal(name="task_progress")
    def task_progress(self, report: TaskProgressReport) -> None:
        self._inbox.append(core.TaskProgress(**report.model_dump()))

    @workflow.signal(name="task_running")
    def task_running(self, report: TaskReport) -> None:
        self._inbox.append(core.TaskRunning(task_id=report.task_id, attempt=report.attempt))

    @workflow.update(name="cancel")
    def cancel(self) -> Status:
        self._inbox.append(core.CancelRequested())
        return self._record().status

    @cancel.validator
    def _validate_cancel(self) -> None:
        job = self._record()
        if job.state in RUN_TERMINAL:
            raise ApplicationError(f"run {job.spec.name} already ended: {job.state}", type="RunEnded")
        if job.cancel_requested:
            raise ApplicationError(f"run {job.spec.name} is already being cancelled", type="AlreadyCancelling")

    @workflow.update(name="stop_task")
    def stop_task(self, request: StopTaskRequest) -> Status:
        reason = request.reason or R.StoppedByScheduler.template
        self._inbox.append(core.StopRequested(task_id=request.task_id, reason=reason))
        return self._record().task(request.task_id).status

    @stop_task.validator
    def _validate_stop(self, request: StopTaskRequest) -> None:
        job = self._record()
        try:
            task = job.task(request.task_id)
        except KeyError as missing:
            raise ApplicationError(str(missing.args[0]), type="UnknownTask") from None
        if task.final:
            raise ApplicationError(
                f"worker {task.id} of run {job.spec.name} already ended: {task.state}", type="TaskEnded"
            )
        if task.state is TaskState.STOPPING:
            raise ApplicationError(f"worker {task.id} of run {job.spec.name} is already stopping", type="Stopping")

    @workflow.query(name="status")
    def status(self) -> Status:
        return self._record().status

    @workflow.query(name="describe")
    def describe(self) -> JobDescription:
        return describe(self._record())

    @workflow.query(name="events")
    def events(self) -> list[Event]:
        return events(self._record())

    @workflow.query(name="scheduler_view")
    def scheduler_view(self) -> SchedulerView:
        """What this run asks of the scheduler, for a scheduler that rebuilds its view."""
        job = self._record()
        pending = [core.task_request(job, t) for t in job.tasks if t.state is TaskState.PENDING and not t.final]
        placed = [core.allocation(job, t) for t in job.tasks if t.node is not None and t.state not in TASK_ENDED]
        return SchedulerView(job_id=job.id, namespace=job.spec.namespace, pending=pending, placed=placed)

    def _record(self) -> JobRecord:
        if self._job is None:
            raise ApplicationError("the run is still being created", type="NotReady")
        return self._job


def _ids(command: core.Start) -> dict[str, object]:
    return {"task_id": command.task_id, "attempt": command.attempt}


def _failure(error: ActivityError) -> tuple[str, str]:
    """The code and reason an agent put on a failed start; an unexplained failure is a start failure."""
    cause = error.cause
    if isinstance(cause, ApplicationError) and cause.type:
        return cause.type, cause.message
    reason = R.ContainerStartFailed(error=str(cause or error))
    return reason.code, reason.text
