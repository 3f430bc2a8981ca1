"""A run's histories whole across continue-as-new: what each earlier run of its workflow folded out of them, read
from the input the run after it was continued with."""

from __future__ import annotations

from typing import Any, NamedTuple

from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from workflows.domain.run.status import Folded, JobRecord
from workflows.domain.run.views import summarised_record
from workflows.messages import JobInput


class Given(NamedTuple):
    """What a run of a run's workflow was continued with, for its history: the entries the run before it folded
    (None: no run before it kept any), and that run's id."""

    folded: Folded | None
    previous: str


Inputs = dict[tuple[str, str], Given]  # what each run of a workflow was continued with, by workflow and run id


async def folds_of(
    temporal: Client, inputs: Inputs, latest: WorkflowHandle[Any, Any], own: Folded
) -> list[Folded] | None:
    """What each run of the workflow folded out of the run's histories, oldest first: the latest run answers for
    itself (`own`), and each earlier one's is in the input the run after it was continued with. None when Temporal no
    longer keeps one of them (it keeps a closed run for its namespace's retention): the summary entry stays."""
    folds: list[Folded] = [own]
    run_id = latest.run_id
    while run_id:
        given = await given_to(temporal, inputs, latest.id, run_id)
        if given is None:
            return None
        if given.folded is None:
            return folds[::-1]
        folds.append(given.folded)
        run_id = given.previous
    return None


async def given_to(temporal: Client, inputs: Inputs, workflow_id: str, run_id: str) -> Given | None:
    """What one run of a workflow was continued with (its input never changes: it is read once into `inputs`), or
    None when Temporal no longer has that run."""
    if (workflow_id, run_id) in inputs:
        return inputs[workflow_id, run_id]
    handle = temporal.get_workflow_handle(workflow_id, run_id=run_id)
    try:
        async for event in handle.fetch_history_events(page_size=1):
            started = event.workflow_execution_started_event_attributes
            break
        else:
            return None
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
        return None
    (job,) = await temporal.data_converter.decode(started.input.payloads, [JobInput])
    record: JobRecord | None = job.record
    # None for the first run, one of a run that keeps nothing it folds, or one that nothing was folded before.
    kept = record is not None and record.protocol >= 4 and summarised_record(record)
    given = Given(record.folded if record is not None and kept else None, started.continued_execution_run_id)
    inputs[workflow_id, run_id] = given
    return given
