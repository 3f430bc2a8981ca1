"""DeletedRunsWorkflow (id `deleted-runs`): the tombstones of deleted runs, durable and shared by every client.

A delete's last step adds one (update `add_tombstone`) before the run's workflow is removed from Temporal; clients
read them (query `tombstones`) to list deleted runs, to refuse to serve a run whose removal Temporal has not finished
yet, and to reuse its name; a machine that was down during a delete reads them when it comes back. It runs no
activity; its history grows by each delete only, and is carried on when it is long (the newest KEPT_TOMBSTONES)."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.domain.tombstones import Tombstone, matching, with_tombstone
    from workflows.messages import DeletedRunsInput, TombstonesQuery


@workflow.defn(name=contracts.DELETED_RUNS_WORKFLOW)
class DeletedRunsWorkflow:
    @workflow.init
    def __init__(self, input: DeletedRunsInput) -> None:
        self._tombstones: list[Tombstone] = list(input.tombstones)

    @workflow.run
    async def run(self, input: DeletedRunsInput) -> None:
        await workflow.wait_condition(lambda: workflow.info().is_continue_as_new_suggested())
        await workflow.wait_condition(workflow.all_handlers_finished)
        workflow.continue_as_new(DeletedRunsInput(tombstones=self._tombstones))

    @workflow.update(name=contracts.ADD_TOMBSTONE.name)
    def add_tombstone(self, tombstone: Tombstone) -> Tombstone:
        self._tombstones = with_tombstone(self._tombstones, tombstone)
        return tombstone

    @workflow.query(name=contracts.TOMBSTONES.name)
    def tombstones(self, asked: TombstonesQuery) -> list[Tombstone]:
        return matching(self._tombstones, asked.namespace, asked.runs)
