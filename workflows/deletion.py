"""DeleteRunWorkflow (id `delete/<ns>/<name>`): deleting a run, durably, in three steps.

1. `end_run` (control plane): the run is cancelled (update `delete`: its workers stopped with "Run deleted") and
   its workflow closes as any cancelled run's does.
2. `delete_run_files` on each machine that is not Down (its own task queue): its attempts' directories or
   containers, logs and files are removed. A machine that does not pick it up in time (it went down meanwhile) is
   left: a machine removes the files of deleted runs when it registers again.
3. `forget_run` (control plane): its workflow runs and its logs' workflows are removed from Temporal, then its
   tombstone is kept (DeletedRunsWorkflow), which frees its name (see workers/client.py `submit`).
Each step is idempotent, so a control plane that dies midway finishes the delete when the workflow resumes."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import CONTROL_TASK_QUEUE, node_task_queue
    from workflows.domain.tombstones import Tombstone
    from workflows.messages import DeleteRunFilesInput, DeleteRunInput, EndRunInput, ForgetRunInput

# A machine gets this long to pick its part up, a few times: one that does not is down, and cleans up on its return.
MACHINE_PICKS_UP = timedelta(seconds=10)
MACHINE_TRIES = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_attempts=3)


@workflow.defn(name=contracts.DELETE_RUN_WORKFLOW)
class DeleteRunWorkflow:
    @workflow.run
    async def run(self, input: DeleteRunInput) -> Tombstone:
        deleted_at = workflow.now()
        ended = await workflow.execute_activity(
            contracts.end_run,
            EndRunInput(namespace=input.namespace, name=input.name),
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(hours=1),  # its workers' stops, each within its grace period
            heartbeat_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), non_retryable_error_types=["NoSuchRun"]),
            summary=f"cancel {input.namespace}/{input.name}",
        )
        files = DeleteRunFilesInput(namespace=input.namespace, job=input.name)
        parts = [
            workflow.execute_activity(
                contracts.delete_run_files,
                files,
                task_queue=node_task_queue(machine),
                schedule_to_start_timeout=MACHINE_PICKS_UP,
                start_to_close_timeout=timedelta(minutes=10),
                heartbeat_timeout=timedelta(seconds=30),
                retry_policy=MACHINE_TRIES,
                summary=f"remove its files on {machine}",
            )
            for machine in ended.machines
        ]
        for machine, done in zip(ended.machines, await asyncio.gather(*parts, return_exceptions=True), strict=True):
            if isinstance(done, ActivityError):
                workflow.logger.warning("%s: left to remove its files when it comes back: %s", machine, done)
            elif isinstance(done, BaseException):
                raise done
        tombstone = Tombstone(
            namespace=input.namespace,
            name=input.name,
            run_id=ended.run_id,
            deleted_by=input.by,
            deleted_at=deleted_at,
            created_at=ended.created_at,
            last_state=ended.state,
            last_reason=ended.reason,
        )
        await workflow.execute_activity(
            contracts.forget_run,
            ForgetRunInput(tombstone=tombstone),
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(minutes=5),
            retry_policy=contracts.PATIENT,
            summary=f"forget {input.namespace}/{input.name}",
        )
        return tombstone
