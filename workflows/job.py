"""JobWorkflow: one run, durable. It turns messages into domain events and carries out the core's commands."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from temporalio import workflow
from temporalio.common import SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError

with workflow.unsafe.imports_passed_through():
    from workflows import activity_failures, contracts
    from workflows.contracts import CONTROL_TASK_QUEUE, NODES_KEY, SCHEDULER_TASK_QUEUE, STATE_KEY, node_task_queue
    from workflows.domain.reasons import R, error_text
    from workflows.domain.refs import TaskRef
    from workflows.domain.run import events as ev
    from workflows.domain.run.effects import (
        Effect,
        covered_in_a_live_run,
        difference,
        effects,
        identities,
        identity,
        one_offs,
    )
    from workflows.domain.run.job import FirstPlacement, decide, fail_undecided, is_settled
    from workflows.domain.run.refusals import Refusal, refuse_cancel, refuse_stop
    from workflows.domain.run.status import RUN_TERMINAL, Folded, JobRecord, RunState, Status, history_long
    from workflows.domain.run.tasks import asked_of_scheduler, attempts_on, new_job, nodes_in_use
    from workflows.domain.run.views import Event, JobDescription, describe, events
from workflows.messages import (
    RUN_FAILED,
    AttemptsOnNode,
    AttemptsQuery,
    CancelRunInput,
    JobInput,
    LoadSettingsInput,
    PlaceInput,
    PlaceResult,
    PlanInput,
    ReleaseInput,
    SchedulerView,
    StartTaskInput,
    StopTaskInput,
    StopTaskRequest,
)
from workflows.watches import AttemptKey, Watches, task_ref

T = TypeVar("T")

# A change of behaviour that histories recorded before it must not see on replay (workflow.patched): Temporal's
# cancellation request became the run's cancel (it used to close the workflow at once, its workers running). It
# may arrive before the run knows its protocol (messages.PROTOCOL), which versions the rest.
CANCEL_REQUEST_PATCH = "cancel-request-cancels-the-run"


@workflow.defn(name=contracts.JOB_WORKFLOW)
class JobWorkflow:
    def __init__(self) -> None:
        self._job: JobRecord | None = None
        self._inbox: list[ev.Event] = []
        self._busy: set[asyncio.Task[None]] = set()  # calls that must finish (place, release, start, stop)
        self._watches = Watches(self._inbox_append)  # the supervisors of its workers on their machines
        self._starting: set[AttemptKey] = set()  # start calls in flight
        self._timers: set[asyncio.Task[None]] = set()  # cancelled when the run closes or continues as new
        self._in_flight: dict[Effect, asyncio.Future[None]] = {}  # protocol 6: what is in flight, by identity
        self._nodes: list[str] = []
        self._state = RunState.PENDING.value  # the AstraeusState the run was started with
        self._first = FirstPlacement()  # what load_settings placed for the first decision, until it is taken
        self._first_at: datetime | None = None  # when that decision is made: when load_settings was asked

    # ---- run --------------------------------------------------------------------------------------------------

    @workflow.run
    async def run(self, input: JobInput) -> Status:
        if input.record is not None:
            # What the run before folded stays in this run's input, where clients read it (workers/folds.py).
            self._job = input.record.model_copy(update={"folded": Folded()})
            # Nothing is in flight in a new workflow run: it carries out what the record needs (the difference from
            # nothing). Afterwards each decision's commands carry the run on, as they did in the run before (since
            # protocol 6, the difference from what is in flight after each decision).
            if self._job.protocol >= 6:
                self._run_difference([])
            else:
                for command in effects(self._job, workflow.now()):
                    self._carry_out(command)
        else:
            began = workflow.now()
            loaded = await self._despite_cancel(
                lambda: workflow.execute_local_activity(
                    contracts.load_settings,
                    LoadSettingsInput(spec=input.spec, at=began),
                    start_to_close_timeout=timedelta(seconds=30),
                    retry_policy=contracts.PATIENT,
                    local_retry_threshold=timedelta(seconds=2),
                    summary="load settings and place",
                )
            )
            # The first decision is taken when load_settings was asked, at the time it recorded (`at`): a replay may
            # see another workflow.now() here, as a workflow task that completed empty while load_settings ran is
            # replayed as one with the next. Given that decision's requests and their answers, the run takes the
            # answers instead of calling `place` (histories without them call it; those before `at` used `began`).
            if loaded.requests:
                self._first = FirstPlacement.of(loaded.requests, loaded.answers)
            self._first_at = loaded.at or (began if loaded.requests else None)
            self._job = new_job(input.spec, loaded.settings, self._first_at or workflow.now())
            self._job.protocol = loaded.protocol
            self._inbox.insert(0, ev.Created())  # before a cancellation that arrived meanwhile
        self._publish()
        while True:
            await self._despite_cancel(
                lambda: workflow.wait_condition(lambda: bool(self._inbox) or self._settled() or self._continue_now())
            )
            if self._inbox:
                batch, self._inbox = self._inbox, []
                now, self._first_at = self._first_at or workflow.now(), None
                try:
                    self._job, commands = decide(self._job, batch, now)
                except workflow.NondeterminismError:
                    raise
                except Exception as error:  # a bug of the core fails this run, never its workflow task for ever
                    workflow.logger.exception("cannot decide %s", [type(event).__name__ for event in batch])
                    self._job, commands = fail_undecided(self._job, error_text(error), workflow.now())
                if self._job.protocol >= 6:
                    self._run_difference(commands)
                else:
                    for command in commands:
                        self._carry_out(command)
                for release in self._first.unasked():
                    self._spawn(self._release(release))
                self._watches.forget_gone(self._job)
                self._publish()
            elif self._settled():
                if self._job.protocol < 2:
                    self._cancel_background()  # a closing workflow drops its timers: cancelling them writes events
                return await self._close()
            else:
                await self._despite_cancel(self._continue_as_new)

    async def _despite_cancel(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Await `operation`; a cancellation request that interrupts it is the run's cancel, and it is done again.

        Temporal's cancellation request (the UI's Request Cancellation, `WorkflowHandle.cancel()`) cancels only this
        main coroutine: the activities it then starts, and those of the other tasks (stops, releases, supervisors),
        are not cancelled, so the run goes on deciding until its workers are stopped, as `astraeus cancel` does."""
        while True:
            try:
                return await operation()
            except (asyncio.CancelledError, ActivityError) as error:
                if not activity_failures.cancellation(error) or workflow.cancellation_reason() is None:
                    raise
                if not workflow.patched(CANCEL_REQUEST_PATCH):
                    raise  # recorded when a cancellation request closed the workflow at once
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()  # handled: later awaits must not see it again
                self._inbox.append(ev.CancelRequested())  # a no-op for a run already cancelling or ended

    async def _close(self) -> Status:
        """Close the workflow as the run ended, so that the Temporal UI's badge and filters tell the truth: a Completed
        run's workflow returns its Status, a Failed one's fails (type RunFailed, the Status as details, its reason as
        message), a Cancelled one's is Canceled (its Status is read with the `status` query)."""
        assert self._job is not None
        status = self._job.status
        if self._job.protocol < 2:
            return status  # runs created before protocol 2: every run's workflow completed with its Status
        if status.state == RunState.FAILED:
            raise ApplicationError(status.reason, status, type=RUN_FAILED, non_retryable=True)
        if status.state == RunState.CANCELLED:
            await self._cancel_own_workflow(status.reason)
            raise CancelledError(status.reason)
        return status

    async def _cancel_own_workflow(self, reason: str) -> None:
        """The SDK closes a workflow Canceled only after Temporal was asked to cancel it, and a workflow may not ask it
        of itself: a run cancelled otherwise (`astraeus cancel`, every worker stopped) asks the control plane to."""
        if workflow.cancellation_reason() is not None:
            return
        info = workflow.info()
        try:
            await workflow.execute_activity(
                contracts.cancel_run_workflow,
                CancelRunInput(workflow_id=info.workflow_id, run_id=info.run_id, reason=reason),
                task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=contracts.PATIENT,
                summary="close the workflow as cancelled",
            )
            await workflow.wait_condition(lambda: workflow.cancellation_reason() is not None)
        except (asyncio.CancelledError, ActivityError) as error:
            if not activity_failures.cancellation(error):
                raise

    def _settled(self) -> bool:
        # Close only once the run ended and every call that must finish (stops, releases) finished.
        return self._job is not None and is_settled(self._job) and not self._busy

    def _continue_now(self) -> bool:
        """History grew long, or the run holds `history_keep` entries folded out of one of its histories: continue
        as new at a quiet moment (no call in flight that a new run cannot redo)."""
        assert self._job is not None
        info = workflow.info()
        long = history_long(self._job, info.is_continue_as_new_suggested(), info.get_current_history_length())
        return long and not self._busy and not is_settled(self._job)

    async def _continue_as_new(self) -> None:
        assert self._job is not None
        background = [*self._watches.supervisors.values(), *self._timers]
        self._cancel_background()
        await asyncio.gather(*background, return_exceptions=True)  # nothing may follow continue_as_new
        await workflow.wait_condition(workflow.all_handlers_finished)
        if self._inbox:
            return  # a message arrived meanwhile: decide it first; the run continues as new afterwards
        workflow.continue_as_new(JobInput(spec=self._job.spec, record=self._job))

    def _publish(self) -> None:
        assert self._job is not None
        status = self._job.status
        # Each upsert is a history event: write only what changed.
        updates: list[SearchAttributeUpdate[Any]] = []
        if status.state != self._state:
            self._state = status.state
            updates.append(STATE_KEY.value_set(status.state))
        nodes = nodes_in_use(self._job) if self._job.protocol < 2 else []  # protocol 2: the scheduler knows them
        if nodes != self._nodes:
            self._nodes = nodes
            updates.append(NODES_KEY.value_set(nodes) if nodes else NODES_KEY.value_unset())
        if updates:
            workflow.upsert_search_attributes(updates)
        workflow.set_current_details(f"**{status.state}**: {status.reason}")

    # ---- commands ---------------------------------------------------------------------------------------------

    def _run_difference(self, commands: list[ev.Command]) -> None:
        """Protocol 6: make what is in flight what the record needs (`effects`), by identity. What is no longer
        needed leaves the table: a timer is cancelled; a supervisor is cancelled once its worker left its machine
        (`Watches.forget_gone`, as before); other calls finish, their answers decided as they come. A call that ended
        or a timer that fired stays while the record still needs it, unless `decide` issues it anew (a replan): the
        scheduler holds a place it answered "wait", a stop goes on on the machine, and a back-off that ran out while
        its gang was still leaving must not fire again and again. Then what is needed and not in flight starts,
        after what `decide` issued to be done once (a release), which is no effect."""
        assert self._job is not None
        needed = effects(self._job, workflow.now())
        wanted = identities(needed)
        reissued = identities(commands)
        for effect, call in list(self._in_flight.items()):
            if effect not in wanted:
                del self._in_flight[effect]
                if effect.kind == "timer":
                    call.cancel()  # a no-op for one that fired
            elif call.done() and effect in reissued:
                del self._in_flight[effect]
        for command in one_offs(commands, wanted):
            self._carry_out(command)
        covered = set(self._in_flight) | covered_in_a_live_run(self._job)
        for command in difference(needed, covered):
            call = self._carry_out(command)
            for effect in identity(command):
                self._in_flight[effect] = call

    def _carry_out(self, command: ev.Command) -> asyncio.Future[None]:
        """Set `command` going; the call (or the supervisor) that does it."""
        match command:
            case ev.Place() if (answers := self._first.take(command)) is not None:
                self._inbox.extend(answers)  # placed by load_settings: decided next
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                done.set_result(None)
                return done
            case ev.Place():
                return self._spawn(self._place(command))
            case ev.PlanGroup():
                return self._spawn(self._plan(command))
            case ev.Release():
                return self._spawn(self._release(command))
            case ev.Start():
                return self._spawn(self._start(command))
            case ev.Supervise():
                assert self._job is not None
                return self._watches.supervise(self._job, command.task_id, command.attempt, command.node)
            case ev.Stop():
                return self._spawn(self._stop(command))
            case ev.ArmTimer():
                timer = asyncio.ensure_future(self._timer(command))
                self._timers.add(timer)
                timer.add_done_callback(self._timers.discard)
                return timer
        raise AssertionError(f"a command the workflow cannot carry out: {command!r}")

    def _spawn(self, effect: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(effect)
        self._busy.add(task)
        task.add_done_callback(self._busy.discard)
        return task

    def _ref(self, task_id: str, attempt: int) -> TaskRef:
        assert self._job is not None
        return task_ref(self._job, task_id, attempt)

    async def _place(self, command: ev.Place) -> None:
        # None in histories from before the scheduler answered in its result
        result: PlaceResult | None = await self._scheduler(
            contracts.place,
            PlaceInput(requests=command.requests),
            f"place {', '.join(r.task_id for r in command.requests)}",
        )
        self._inbox.extend(result.answers if result is not None else [])

    async def _plan(self, command: ev.PlanGroup) -> None:
        plan = await workflow.execute_activity(
            contracts.plan_group,
            PlanInput(request=command.request, total_gpus=command.total_gpus, machines=command.machines),
            task_queue=SCHEDULER_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=contracts.PATIENT,
            summary=f"plan group {command.group}",
        )
        self._inbox.append(ev.GroupPlanned(group=command.group, **plan.model_dump()))

    async def _release(self, command: ev.Release) -> None:
        assert self._job is not None
        await self._scheduler(
            contracts.release,
            ReleaseInput(job_id=self._job.id, task_id=command.task_id, attempt=command.attempt),
            f"release {command.task_id}",
        )

    async def _scheduler(self, call: Callable[[contracts.In], Awaitable[T]], message: contracts.In, summary: str) -> T:
        """Call the scheduler: since protocol 3 a local activity through the scheduler's door (one marker event,
        and no workflow task of its own: activities/scheduler_link.py), before that an activity on its queue."""
        assert self._job is not None
        if self._job.protocol >= 3:
            return await workflow.execute_local_activity(
                call,
                message,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=contracts.PATIENT,
                # While the scheduler is away, a retry after more than 2 s waits on a timer, the workflow task
                # ended: the run answers queries meanwhile (the restarted scheduler's rebuild asks each run).
                local_retry_threshold=timedelta(seconds=2),
                summary=summary,
            )
        return await workflow.execute_activity(
            call,
            message,
            task_queue=SCHEDULER_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=contracts.PATIENT,
            summary=summary,
        )

    async def _start(self, command: ev.Start) -> None:
        """Start the worker on its machine and watch it: one activity (run_task) does both, reporting it running
        on the way. A gang member is first only set up (barrier): a second call starts it once every member is
        ready. Runs created before run_task existed start it (start_task), then watch it (supervise_task)."""
        assert self._job is not None
        if self._job.protocol >= 2 and not command.barrier:
            start = self._start_input(command)
            self._watches.supervise(self._job, command.task_id, command.attempt, command.node, start)
            return
        key = (command.task_id, command.attempt)
        self._starting.add(key)
        try:
            result = await workflow.execute_activity(
                contracts.start_task,
                self._start_input(command),
                task_queue=node_task_queue(command.node),
                start_to_close_timeout=timedelta(minutes=10),
                heartbeat_timeout=timedelta(seconds=60),
                retry_policy=contracts.PATIENT,
                summary=f"start {command.task_id} on {command.node}",
            )
        except ActivityError as error:
            failed = ev.TaskSetupFailed(
                task_id=command.task_id, attempt=command.attempt, reason=activity_failures.start_failure(error)
            )
            self._inbox.append(failed)
            return
        finally:
            self._starting.discard(key)
        if not result.started:
            ready = ev.TaskReady(
                task_id=command.task_id,
                attempt=command.attempt,
                picked_up_at=result.picked_up_at,
                node_address=result.node_address,
            )
            self._inbox.append(ready)
            return
        self._inbox.append(ev.TaskStarted(task_id=command.task_id, attempt=command.attempt))
        self._watches.supervise(self._job, command.task_id, command.attempt, command.node)

    def _start_input(self, command: ev.Start) -> StartTaskInput:
        return StartTaskInput(
            ref=self._ref(command.task_id, command.attempt),
            group=command.group,
            barrier=command.barrier,
            env=command.env,
            host_network=command.host_network,
        )

    def _inbox_append(self, event: ev.Event) -> None:
        self._inbox.append(event)

    def _cancel_background(self) -> None:
        self._watches.cancel_all()
        for timer in list(self._timers):
            timer.cancel()
        self._in_flight.clear()

    async def _stop(self, command: ev.Stop) -> None:
        assert self._job is not None
        grace = self._job.settings.stop_grace_seconds
        await workflow.execute_activity(
            contracts.stop_task,
            StopTaskInput(ref=self._ref(command.task_id, command.attempt), grace_seconds=grace),
            task_queue=node_task_queue(command.node),
            start_to_close_timeout=timedelta(seconds=grace + 60),
            heartbeat_timeout=timedelta(seconds=30),
            retry_policy=contracts.PATIENT,
            summary=f"stop {command.task_id} on {command.node}",
        )
        key = (command.task_id, command.attempt)
        if key not in self._watches.supervisors and key not in self._starting:
            # Nothing ran, so nothing else reports its end (a gang member stopped at the barrier).
            self._inbox.append(ev.StopConfirmed(task_id=command.task_id, attempt=command.attempt))

    async def _timer(self, command: ev.ArmTimer) -> None:
        await workflow.sleep(max((command.at - workflow.now()).total_seconds(), 0), summary=command.timer.value)
        self._inbox.append(ev.TimerFired(timer=command.timer, task_id=command.task_id, attempt=command.attempt))

    # ---- messages ---------------------------------------------------------------------------------------------

    # Each signal carries its domain event itself: a handler only queues it for the next decision.

    @workflow.signal(name=contracts.PLACEMENT.name)
    def placement(self, answer: ev.PlacementUpdate) -> None:
        self._inbox.append(answer)

    @workflow.signal(name=contracts.TASK_PROGRESS.name)
    def task_progress(self, report: ev.TaskProgress) -> None:
        self._inbox.append(report)

    @workflow.signal(name=contracts.TASK_RUNNING.name)
    def task_running(self, report: ev.TaskRunning) -> None:
        self._watches.reported_running.add((report.task_id, report.attempt))
        self._inbox.append(report)

    @workflow.signal(name=contracts.TASK_HEALTH.name)
    def task_health(self, report: ev.TaskHealth) -> None:
        self._inbox.append(report)

    @workflow.signal(name=contracts.MACHINE_LOST.name)
    def machine_lost(self, report: ev.MachineLost) -> None:
        self._inbox.append(report)

    @workflow.signal(name=contracts.MACHINE_HEARD.name)
    def machine_heard(self, report: ev.MachineHeard) -> None:
        if not report.late and self._job is not None and self._job.protocol >= 7:
            self._watches.attach_again(report.node)
        self._inbox.append(report)

    @workflow.signal(name=contracts.TASK_EXITED_WHILE_LOST.name)
    def task_exited_while_lost(self, report: ev.ExitedWhileLost) -> None:
        self._inbox.append(report)

    @workflow.signal(name=contracts.PREEMPT.name)
    def preempt(self, request: ev.Preempt) -> None:
        self._inbox.append(request)

    @workflow.update(name=contracts.CANCEL.name)
    def cancel(self) -> Status:
        self._inbox.append(ev.CancelRequested())
        return self._record().status

    @cancel.validator
    def _validate_cancel(self) -> None:
        _refuse(refuse_cancel(self._record()))

    @workflow.update(name=contracts.DELETE.name)
    def delete(self) -> Status:
        """The run is being deleted: cancelled as `cancel` does, its workers stopped with "Run deleted". A run that
        ended or is being cancelled already is left as it is (nothing refused: the delete goes on)."""
        self._inbox.append(ev.CancelRequested(deleting=True))
        return self._record().status

    @workflow.update(name=contracts.REQUEST_STOP.name)
    def request_stop(self, request: StopTaskRequest) -> Status:
        reason = request.reason or R.StoppedByScheduler.template
        self._inbox.append(ev.StopRequested(task_id=request.task_id, reason=reason))
        return self._record().task(request.task_id).status

    @request_stop.validator
    def _validate_stop(self, request: StopTaskRequest) -> None:
        _refuse(refuse_stop(self._record(), request.task_id))

    @workflow.query(name=contracts.STATUS.name)
    def status(self) -> Status:
        return self._record().status

    @workflow.query(name=contracts.DESCRIBE.name)
    def describe(self) -> JobDescription:
        return describe(self._record())

    @workflow.query(name=contracts.EVENTS.name)
    def events(self) -> list[Event]:
        return events(self._record())

    @workflow.query(name=contracts.FOLDED.name)
    def folded(self) -> Folded:
        """The entries this run of the workflow folded out of the run's histories (its input holds those the run
        before it folded): clients put them back to serve the whole history."""
        return self._record().folded

    @workflow.query(name=contracts.ATTEMPTS_ON.name)
    def attempts_on(self, query: AttemptsQuery) -> AttemptsOnNode:
        """The attempts this run has on a machine now: an agent starts, and keeps running, only those (fencing)."""
        job = self._record()
        return AttemptsOnNode(open=job.state not in RUN_TERMINAL, attempts=attempts_on(job, query.node))

    @workflow.query(name=contracts.SCHEDULER_VIEW.name)
    def scheduler_view(self) -> SchedulerView:
        """What this run asks of the scheduler, for a scheduler that rebuilds its view."""
        job = self._record()
        pending, placed = asked_of_scheduler(job)
        return SchedulerView(job_id=job.id, namespace=job.spec.namespace, pending=pending, placed=placed)

    def _record(self) -> JobRecord:
        if self._job is None:
            raise ApplicationError(contracts.BEING_CREATED, type="NotReady")
        return self._job


def _refuse(refusal: Refusal | None) -> None:
    if refusal is not None:
        raise ApplicationError(refusal.text, type=refusal.type)
