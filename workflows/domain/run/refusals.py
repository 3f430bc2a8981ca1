"""What a person's request to a run is refused for, before the run takes it: a cancel of a run that ended or is being
cancelled; a stop of a worker the run does not have, that ended, or that is stopping. JobWorkflow's update validators
raise each refusal as it is: its type is the code clients branch on (`UnknownTask`: exit 3, 404)."""

from __future__ import annotations

from typing import NamedTuple

from workflows.domain.run.status import RUN_TERMINAL, JobRecord, TaskState


class Refusal(NamedTuple):
    text: str
    type: str | None = None  # None: a refusal without a code


def refuse_cancel(job: JobRecord) -> Refusal | None:
    if job.state in RUN_TERMINAL:
        return Refusal(f"run {job.spec.namespace}/{job.spec.name} already ended: {job.state}")
    if job.cancel_requested:
        return Refusal(f"run {job.spec.namespace}/{job.spec.name} is already being cancelled")
    return None


def refuse_stop(job: JobRecord, task_id: str) -> Refusal | None:
    try:
        task = job.task(task_id)
    except KeyError as missing:
        return Refusal(str(missing.args[0]), "UnknownTask")
    if task.final:
        return Refusal(f"worker {task.id} of run {job.spec.name} already ended: {task.state}", "TaskEnded")
    if task.state is TaskState.STOPPING:
        return Refusal(f"worker {task.id} of run {job.spec.name} is already stopping", "Stopping")
    return None
