"""One decision in progress (`Step`): the run being changed, the commands gathered, and the moves every event
handler shares: record a transition, end a worker, restart it by policy, queue it again, stop it.
"""

from __future__ import annotations

from datetime import datetime

from workflows.domain.events import ArmTimer, Command, Place, Release, Start, Stop, Timer
from workflows.domain.lifecycle import TaskEvent, next_state
from workflows.domain.reasons import R, Reason
from workflows.domain.restarts import decide_restart
from workflows.domain.status import (
    RUN_TERMINAL,
    TASK_ON_NODE,
    JobRecord,
    StopCause,
    TaskRecord,
    TaskState,
    record,
)
from workflows.domain.tasks import group_of, task_env, task_request

# Stops after which a gang member waits for the whole gang to be gone, then queues again with it.
GANG_REQUEUE_CAUSES: tuple[StopCause, ...] = ("preempted", "gang_restart", "barrier")


class Step:
    """One decision in progress: the job being changed and the commands gathered."""

    def __init__(self, job: JobRecord, now: datetime) -> None:
        self.job = job
        self.now = now
        self.commands: list[Command] = []

    @property
    def gang(self) -> bool:
        return self.job.spec.gang

    def move(self, task: TaskRecord, event: TaskEvent, reason: Reason, at: datetime | None = None) -> None:
        """Record a transition, now or at `at` (when the machine says it happened)."""
        state = next_state(task.state, event)
        record(task.status, task.history, state, reason, self.now if at is None else at)

    def arm(self, timer: Timer, task: TaskRecord, at: datetime) -> None:
        self.commands.append(ArmTimer(timer=timer, task_id=task.id, attempt=task.attempt, at=at))

    def place(self, *tasks: TaskRecord) -> None:
        if tasks:
            self.commands.append(Place(requests=[task_request(self.job, t) for t in tasks]))

    def start(self, task: TaskRecord, barrier: bool = False) -> None:
        assert task.node is not None
        self.commands.append(
            Start(
                task_id=task.id,
                attempt=task.attempt,
                node=task.node,
                group=group_of(self.job, task),
                barrier=barrier,
                env=task_env(self.job, task),
                host_network=self.gang,
            )
        )

    def end(self, task: TaskRecord, event: TaskEvent, reason: Reason) -> None:
        """The worker's process is gone: record it, give back its room, and decide whether it starts again."""
        self.move(task, event, reason)
        self.commands.append(Release(task_id=task.id, attempt=task.attempt))
        task.status.finished_at = self.now
        task.stale_since = None
        task.healthy = None
        if self.job.state in RUN_TERMINAL or self.job.cancel_requested:
            task.final = True
        elif task.state is TaskState.CANCELLED:
            self._after_stop(task)
        else:
            self._restart_policy(task)

    def _after_stop(self, task: TaskRecord) -> None:
        """A stopped worker is gone: a preempted one queues again, a gang restart waits, the rest are final.
        A gang member stopped for the gang waits for every member to be gone (workflows/domain/gang.py)."""
        if self.gang and task.stop_cause in GANG_REQUEUE_CAUSES:
            return
        if task.stop_cause == "preempted" and task.preempted_by is not None:
            self.requeue(task, R.PreemptedQueuedAgain(run=task.preempted_by))
            self.place(task)
        elif task.stop_cause == "gang_restart" and task.restart_at is not None:
            if self.now >= task.restart_at:  # the failed worker's back-off is over already
                self.requeue(task, task.requeue or R.WaitingForWorkersToStart())
                self.place(task)
            # else the failed worker's restart timer queues it again, with every other member
        else:
            task.final = True

    def _restart_policy(self, task: TaskRecord) -> None:
        policy = group_of(self.job, task).restart_policy
        settings = self.job.settings
        decision = decide_restart(policy, task.state, task.restarts, task.running_since, self.now, settings)
        task.restarts = decision.restarts
        if decision.restart_at is None:
            task.final = True
            if decision.final_reason:
                record(task.status, task.history, task.state, decision.final_reason, self.now)
            return
        task.restart_at = decision.restart_at
        self.arm(Timer.RESTART, task, decision.restart_at)
        if task.state is TaskState.COMPLETED:
            return
        spec = self.job.spec
        if spec.failure_policy == "RestartJob" or (self.gang and task.id == spec.leader_id):
            self.restart_all(task, decision.restart_at)

    def restart_all(self, failed: TaskRecord, at: datetime) -> None:
        """RestartJob (or a gang's leader failed): every worker is queued again with the failed one."""
        reason = R.GangRestart(task=failed.id)
        failed.requeue = reason
        for task in self.job.tasks:
            if task is failed or task.final:
                continue
            task.requeue = reason
            if task.placed_pending:
                task.stop_cause, task.restart_at = "gang_restart", at
                self._cancel_placed(task, reason)
            elif task.state in TASK_ON_NODE and task.state is not TaskState.STOPPING:
                task.stop_cause, task.restart_at = "gang_restart", at
                self.move(task, TaskEvent.STOP, reason)
                self.commands.append(Stop(task_id=task.id, attempt=task.attempt, node=node_of(task)))

    def requeue(self, task: TaskRecord, reason: Reason) -> None:
        """A stopped worker waits for a machine again, as a new attempt, its restart budget untouched."""
        self.move(task, TaskEvent.REQUEUE, reason)
        next_attempt(task)

    def stop(self, task: TaskRecord, reason: Reason) -> None:
        """Stop a worker: a placed one goes Stopping, a waiting one straight to Cancelled."""
        if task.final:
            return
        task.stopped = True
        task.stop_cause = None
        if task.placed_pending:
            self._cancel_placed(task, reason)
        elif task.state is TaskState.PENDING:
            self.move(task, TaskEvent.STOP, reason)
            task.final = True
            task.status.finished_at = self.now
            self.commands.append(Release(task_id=task.id, attempt=task.attempt))
        elif task.state in TASK_ON_NODE and task.state is not TaskState.STOPPING:
            self.move(task, TaskEvent.STOP, reason)
            self.commands.append(Stop(task_id=task.id, attempt=task.attempt, node=node_of(task)))
        elif task.state in TASK_ON_NODE:
            pass  # already stopping: it ends Cancelled, and being stopped it stays final
        else:
            # Ended, waiting out a back-off: it will not start again.
            task.final, task.restart_at = True, None
            record(task.status, task.history, task.state, reason, self.now)

    def stop_for(self, task: TaskRecord, cause: StopCause, reason: Reason) -> None:
        """A stop whose cause decides what follows (preemption, time limit): only a worker on a machine."""
        if task.final or not task.on_node or task.state is TaskState.STOPPING:
            return
        task.stop_cause = cause
        task.stopped = cause == "time_limit"
        if task.placed_pending:
            self._cancel_placed(task, reason)
            return
        self.move(task, TaskEvent.STOP, reason)
        self.commands.append(Stop(task_id=task.id, attempt=task.attempt, node=node_of(task)))

    def _cancel_placed(self, task: TaskRecord, reason: Reason) -> None:
        """A worker placed on a machine that has not picked it up yet is stopped as a Pending one: straight to
        Cancelled (the spec has no Pending -> Stopping edge), its room given back, and what follows the stop
        follows at once (a preempted worker queues again). Its machine is still told to stop it, since it may be
        picking it up right now: a setup under way ends there, and a start already handed to the runtime is
        stopped once it finished."""
        self.commands.append(Stop(task_id=task.id, attempt=task.attempt, node=node_of(task)))
        self.end(task, TaskEvent.STOP, reason)


def node_of(task: TaskRecord) -> str:
    assert task.node is not None
    return task.node


def next_attempt(task: TaskRecord) -> None:
    task.attempt += 1
    task.restart_at = task.node = task.address = task.running_since = task.stale_since = None
    task.stop_cause, task.requeue, task.final, task.stopped = None, None, False, False
    task.released, task.healthy = False, None
