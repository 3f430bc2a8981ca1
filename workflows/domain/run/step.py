"""One decision in progress (`Step`): the run being changed, the commands gathered, and the moves every event
handler shares: record a transition, end a worker, restart it by policy, queue it again, stop it.
"""

from __future__ import annotations

from datetime import datetime

from workflows.domain.reasons import R, Reason
from workflows.domain.run.events import ArmTimer, Command, Place, Release, Start, Stop, Timer
from workflows.domain.run.lifecycle import TaskEvent, next_state
from workflows.domain.run.restarts import decide_restart, restarted_reason
from workflows.domain.run.status import (
    RUN_TERMINAL,
    TASK_ON_NODE,
    Attempt,
    Final,
    JobRecord,
    RequeueWithGang,
    RestartAt,
    StopCause,
    StopIntent,
    TaskRecord,
    TaskState,
    record,
)
from workflows.domain.run.tasks import group_of, task_env, task_request

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
        self.commands.append(ArmTimer(timer=timer, task_id=task.id, attempt=task.attempt.number, at=at))

    def place(self, *tasks: TaskRecord) -> None:
        if tasks:
            self.commands.append(Place(requests=[task_request(self.job, t) for t in tasks]))

    def start(self, task: TaskRecord, barrier: bool = False) -> None:
        assert task.node is not None
        self.commands.append(
            Start(
                task_id=task.id,
                attempt=task.attempt.number,
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
        self.commands.append(Release(task_id=task.id, attempt=task.attempt.number))
        task.status.finished_at = self.now
        task.attempt.stale_since = None
        task.attempt.healthy = None
        if self.job.state in RUN_TERMINAL or self.job.cancel_requested:
            end_for_good(task)
        elif task.state is TaskState.CANCELLED:
            self._after_stop(task)
        else:
            self._restart_policy(task)

    def _after_stop(self, task: TaskRecord) -> None:
        """A stopped worker is gone: a preempted one queues again, a gang restart waits, the rest are final.
        A gang member stopped for the gang waits for every member to be gone (workflows/domain/run/gang.py)."""
        cause = task.stop.cause if task.stop is not None else None
        match cause, task.after:
            case _ if self.gang and cause in GANG_REQUEUE_CAUSES:
                return
            case "preempted", _ if task.preempted_by is not None:
                self.requeue(task, R.PreemptedQueuedAgain(run=task.preempted_by))
                self.place(task)
            case "gang_restart", RequeueWithGang(reason=reason, at=datetime() as at):
                if self.now >= at:  # the failed worker's back-off is over already
                    self.requeue(task, reason)
                    self.place(task)
                # else the failed worker's restart timer queues it again, with every other member
            case _:
                end_for_good(task)

    def _restart_policy(self, task: TaskRecord) -> None:
        policy = group_of(self.job, task).restart_policy
        settings = self.job.settings
        decision = decide_restart(policy, task.state, task.restarts, task.attempt.running_since, self.now, settings)
        task.restarts = decision.restarts
        if decision.restart_at is None:
            end_for_good(task)
            if decision.final_reason:
                record(task.status, task.history, task.state, decision.final_reason, self.now)
            return
        at = self._after_fence(task, decision.restart_at)
        task.after = RestartAt(at=at)
        self.arm(Timer.RESTART, task, at)
        if task.state is TaskState.COMPLETED:
            return
        spec = self.job.spec
        if spec.failure_policy == "RestartJob" or (self.gang and task.id == spec.leader_id):
            self.restart_all(task, at)

    def _after_fence(self, task: TaskRecord, at: datetime) -> datetime:
        """When a worker lost with its machine starts again: after its back-off, and never before its copy there has
        surely stopped (its machine's fence), which its reason then says."""
        fence = task.attempt.fenced_until
        if fence is None or fence <= at:
            return at
        reason = R.WaitsForFence(time=fence.strftime("%Y-%m-%d %H:%M:%S"), node=task.node)
        record(task.status, task.history, task.state, reason, self.now)
        return fence

    def restart_all(self, failed: TaskRecord, at: datetime) -> None:
        """RestartJob (or a gang's leader failed): every worker on a machine is stopped and queued again with the
        failed one ("Gang restart: <w> failed"). Only those it stops are marked so: a waiting worker is in the queue
        already and keeps waiting, one stopping already ends as its stop says, and one waiting out a back-off of its
        own is restarted by its policy, with its own reason. Each is one of the new round; in a gang, which leaves
        and comes back whole, the one in its back-off comes back with the others (gang.requeue_gang), not alone."""
        lost = failed.state is TaskState.DOWN and failed.node is not None
        reason = R.GangRestartLost(task=failed.id, node=failed.node) if lost else R.GangRestart(task=failed.id)
        failed.after = RequeueWithGang(reason=reason, at=failed.restart_at)
        for task in self.job.tasks:
            if task is not failed and self.gang and isinstance(task.after, RestartAt):
                again = restarted_reason(task.restarts + 1, self.job.settings)
                task.after = RequeueWithGang(reason=again, at=task.after.at)
            if task is failed or not self.stoppable(task):
                continue
            # Stopped for the restart: queued again once the failed worker's back-off is over.
            task.stop, task.after = StopIntent(cause="gang_restart"), RequeueWithGang(reason=reason, at=at)
            if task.placed_pending:
                self._cancel_placed(task, reason)
            else:
                self.move(task, TaskEvent.STOP, reason)
                self.commands.append(Stop(task_id=task.id, attempt=task.attempt.number, node=node_of(task)))

    def requeue(self, task: TaskRecord, reason: Reason) -> None:
        """A stopped worker waits for a machine again, as a new attempt, its restart budget untouched."""
        self.move(task, TaskEvent.REQUEUE, reason)
        next_attempt(task)

    def stop(self, task: TaskRecord, reason: Reason) -> None:
        """Stop a worker: a placed one goes Stopping, a waiting one straight to Cancelled."""
        if task.final:
            return
        # A stop for good replaces what was to follow its end (a gang restart's requeue, its back-off): its end
        # decides, and being stopped it ends for good.
        task.stop, task.after = StopIntent(cause="requested"), None
        if task.placed_pending:
            self._cancel_placed(task, reason)
        elif task.state is TaskState.PENDING:
            self.move(task, TaskEvent.STOP, reason)
            end_for_good(task)
            task.status.finished_at = self.now
            self.commands.append(Release(task_id=task.id, attempt=task.attempt.number))
        elif task.state in TASK_ON_NODE and task.state is not TaskState.STOPPING:
            self.move(task, TaskEvent.STOP, reason)
            self.commands.append(Stop(task_id=task.id, attempt=task.attempt.number, node=node_of(task)))
        elif task.state in TASK_ON_NODE:
            pass  # already stopping: it ends Cancelled, and being stopped it stays final
        else:
            # Ended, waiting out a back-off: it will not start again.
            task.after = Final()
            record(task.status, task.history, task.state, reason, self.now)

    @staticmethod
    def stoppable(task: TaskRecord) -> bool:
        """On a machine (placed there at least) and not stopping yet, nor ended for good: what a stop with a cause
        (`stop_for`, a restart of all) stops. One waiting, in its back-off or stopping already is left as it is."""
        return not task.final and task.on_node and task.state is not TaskState.STOPPING

    def stop_for(self, task: TaskRecord, cause: StopCause, reason: Reason) -> None:
        """A stop whose cause decides what follows (preemption, time limit): only a worker on a machine."""
        if not self.stoppable(task):
            return
        task.stop = StopIntent(cause=cause)
        if task.placed_pending:
            self._cancel_placed(task, reason)
            return
        self.move(task, TaskEvent.STOP, reason)
        self.commands.append(Stop(task_id=task.id, attempt=task.attempt.number, node=node_of(task)))

    def _cancel_placed(self, task: TaskRecord, reason: Reason) -> None:
        """A worker placed on a machine that has not picked it up yet is stopped as a Pending one: straight to
        Cancelled (the spec has no Pending -> Stopping edge), its room given back, and what follows the stop
        follows at once (a preempted worker queues again). Its machine is still told to stop it, since it may be
        picking it up right now: a setup under way ends there, and a start already handed to the runtime is
        stopped once it finished."""
        self.commands.append(Stop(task_id=task.id, attempt=task.attempt.number, node=node_of(task)))
        self.end(task, TaskEvent.STOP, reason)


def node_of(task: TaskRecord) -> str:
    assert task.node is not None
    return task.node


def next_attempt(task: TaskRecord) -> None:
    """The worker starts over as a new attempt: nothing of the one before (its machine, its stop, what was to
    follow its end) carries over."""
    task.attempt = Attempt(number=task.attempt.number + 1)
    task.stop = task.after = None


def end_for_good(task: TaskRecord) -> None:
    """It ended, or ends once stopped, for good: nothing follows, no back-off is shown."""
    task.after = Final()
