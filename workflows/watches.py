"""A run's watches of its workers on their machines (JobWorkflow's part that awaits them).

One supervisor per attempt on a machine awaits the activity that starts the worker and watches it (run_task), or
watches it again (supervise_task), until it ends: its end is the run's next event. Since protocol 7 a watch sends no
heartbeat (its machine's lease carries the worker's liveness: workflows/domain/machine/liveness.py), and a run whose
machine's lease is taken again attaches its watches there again (`attach_again`): a new agent's predecessor ended with
them, and an exit a watch returned while Temporal was away reached no one.
Before, a watch heartbeated within the stale grace: a missed heartbeat made its worker Stale, and the next watch,
finding it running, brought it back ("Heartbeat received").
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, CancelledError
from temporalio.workflow import ActivityHandle

with workflow.unsafe.imports_passed_through():
    from workflows import activity_failures, contracts
    from workflows.contracts import node_task_queue
    from workflows.domain.refs import TaskRef
    from workflows.domain.run import events as ev
    from workflows.domain.run.status import JobRecord
    from workflows.domain.run.tasks import group_of
    from workflows.messages import RunTaskInput, StartTaskInput, SuperviseInput, TaskExit

# (task id, attempt): one attempt of one task of a run, what its supervisor and its start in flight are keyed by.
AttemptKey = tuple[str, int]


def task_ref(job: JobRecord, task_id: str, attempt: int) -> TaskRef:
    return TaskRef(namespace=job.spec.namespace, job=job.spec.name, task_id=task_id, attempt=attempt)


@dataclass
class _Watch:
    """A supervisor's watch in flight: its machine, its activity, and whether it is cancelled to be attached again."""

    node: str
    handle: ActivityHandle[TaskExit]
    again: bool = False


class Watches:
    def __init__(self, tell: Callable[[ev.Event], None]) -> None:
        self._tell = tell  # queues an event for the run's next decision
        self.supervisors: dict[AttemptKey, asyncio.Task[None]] = {}  # cancelled once their worker leaves its machine
        self.reported_running: set[AttemptKey] = set()  # workers their machine reported running (run_task: started)
        # Protocol 7: each supervisor's watch in flight, on its machine
        self._watches: dict[AttemptKey, _Watch] = {}

    def supervise(
        self, job: JobRecord, task_id: str, attempt: int, node: str, start: StartTaskInput | None = None
    ) -> asyncio.Task[None]:
        """The attempt's supervisor, begun unless it is already: with `start`, it starts the worker first."""
        key = (task_id, attempt)
        if key not in self.supervisors:
            self.supervisors[key] = asyncio.ensure_future(self._watch(job, key, node, start))
        return self.supervisors[key]

    async def _watch(self, job: JobRecord, key: AttemptKey, node: str, start: StartTaskInput | None) -> None:
        """Supervise until the worker ends; with `start`, start it first in the same activity (run_task), which is
        called again until the worker is reported running (the agent finds what it started)."""
        task_id, attempt = key
        settings = job.settings
        readiness = group_of(job, job.task(task_id)).readiness
        reattach = False
        beats = job.protocol < 7  # since, its machine's lease carries its liveness
        while True:
            starting = start is not None and key not in self.reported_running
            options: dict[str, Any] = {
                "task_queue": node_task_queue(node),
                "start_to_close_timeout": timedelta(days=3650),
                "heartbeat_timeout": timedelta(seconds=settings.stale_grace_seconds) if beats else None,
                "retry_policy": contracts.ONCE,
                "summary": f"{'run' if starting else 'supervise'} {task_id} on {node}",
            }
            watch: ActivityHandle[TaskExit]
            if start is not None and starting:
                message = RunTaskInput(start=start, settings=settings, readiness=readiness)
                watch = workflow.start_activity(contracts.run_task, message, **options)
            else:
                ref = task_ref(job, task_id, attempt)
                again = SuperviseInput(ref=ref, settings=settings, reattach=reattach, readiness=readiness)
                watch = workflow.start_activity(contracts.supervise_task, again, **options)
            this = self._watches[key] = _Watch(node, watch)
            try:
                result = await watch
            except ActivityError as error:
                if isinstance(error.cause, CancelledError):
                    if this.again:  # its machine's lease was taken again: attach again (the agent has it)
                        reattach = True
                        continue
                    return  # the worker left its machine, or the run continues as new
                if starting and key not in self.reported_running:
                    if activity_failures.setup_failed(error):
                        reason = activity_failures.start_failure(error)
                        self._tell(ev.TaskSetupFailed(task_id=task_id, attempt=attempt, reason=reason))
                        return
                    await workflow.sleep(1)  # the agent restarted, or was busy: start again (it finds its own)
                    continue
                if activity_failures.heartbeat_missed(error):
                    self._tell(ev.HeartbeatLate(task_id=task_id, attempt=attempt))
                else:
                    await workflow.sleep(1)  # the agent restarted, or refused: watch again
                reattach = True
                continue
            finally:
                if self._watches.get(key) is this:
                    del self._watches[key]
            self._tell(ev.TaskEnded(task_id=task_id, attempt=attempt, **result.model_dump()))
            return

    def attach_again(self, node: str) -> None:
        """`node`'s lease was taken again (by its agent, or a new one: the one before died with the watches it ran):
        each watch there is attached again, to the worker the agent kept or adopted, or to the exit it left."""
        for watch in self._watches.values():
            if watch.node == node and not watch.handle.done():
                watch.again = True
                watch.handle.cancel()

    def forget_gone(self, job: JobRecord) -> None:
        """Cancel the supervisors of workers that left their machine (ended, lost, or a new attempt)."""
        on_node = {(t.id, t.attempt.number) for t in job.tasks if t.on_node}
        for key in [k for k in self.supervisors if k not in on_node]:
            self.supervisors.pop(key).cancel()

    def cancel_all(self) -> list[asyncio.Task[None]]:
        """Cancel every supervisor (the run closes or continues as new); those cancelled."""
        cancelled = list(self.supervisors.values())
        for supervisor in cancelled:
            supervisor.cancel()
        self.supervisors.clear()
        return cancelled
