"""QuotasWorkflow (id `quotas`): every namespace's quota, durable. `astraeus quota set|rm` are its updates; each
change is handed to the scheduler (`quotas_changed`), which also reads them back (`quotas` query) when it rebuilds."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ApplicationError

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import SCHEDULER_TASK_QUEUE
    from workflows.domain.scheduling.quotas import Quota
    from workflows.messages import QuotasChangedInput, QuotasInput, RemoveQuotaRequest


@workflow.defn(name=contracts.QUOTAS_WORKFLOW)
class QuotasWorkflow:
    @workflow.init
    def __init__(self, input: QuotasInput) -> None:
        self._quotas: dict[str, Quota] = {q.namespace: q for q in input.quotas}
        self._changes = 0  # changes made; the scheduler is told after each one
        self._told = 0

    @workflow.run
    async def run(self, input: QuotasInput) -> None:
        while True:
            await workflow.wait_condition(
                lambda: self._changes != self._told or workflow.info().is_continue_as_new_suggested()
            )
            if self._changes == self._told:
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(QuotasInput(quotas=self._list()))
            self._told = self._changes
            await workflow.execute_activity(
                contracts.quotas_changed,
                QuotasChangedInput(quotas=self._list()),
                task_queue=SCHEDULER_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=contracts.PATIENT,
                summary="tell the scheduler",
            )

    def _list(self) -> list[Quota]:
        return [self._quotas[ns] for ns in sorted(self._quotas)]

    @workflow.update(name=contracts.SET_QUOTA.name)
    def set_quota(self, quota: Quota) -> list[Quota]:
        """Replace the namespace's quota (limits not given are unlimited)."""
        self._quotas[quota.namespace] = quota
        self._changes += 1
        return self._list()

    @workflow.update(name=contracts.REMOVE_QUOTA.name)
    def remove_quota(self, request: RemoveQuotaRequest) -> list[Quota]:
        del self._quotas[request.namespace]
        self._changes += 1
        return self._list()

    @remove_quota.validator
    def _validate_remove(self, request: RemoveQuotaRequest) -> None:
        if request.namespace not in self._quotas:
            raise ApplicationError(f"namespace {request.namespace} has no quota", type="NoQuota")

    @workflow.query(name=contracts.QUOTAS.name)
    def quotas(self) -> list[Quota]:
        return self._list()
