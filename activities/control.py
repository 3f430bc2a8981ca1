"""Activities of the control plane itself."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities import deletion
from workflows import contracts
from workflows.contracts import SA_NODES, implements
from workflows.domain.events import MachineLost
from workflows.domain.settings import Settings
from workflows.messages import PROTOCOL, CancelRunInput, EndedRun, EndRunInput, ForgetRunInput, LoadSettingsResult


class ControlActivities:
    def __init__(self, settings: Settings, client: Client) -> None:
        self._settings = settings
        self._client = client

    @implements(contracts.load_settings)
    async def load_settings(self) -> LoadSettingsResult:
        """The operator's settings and this version's protocol, recorded in each run's history when it starts (so
        replay sees the same)."""
        return LoadSettingsResult(settings=self._settings, protocol=PROTOCOL)

    @implements(contracts.tell_runs_machine_lost)
    async def tell_runs_machine_lost(self, report: MachineLost) -> int:
        """Tell every open run with a worker on the machine (search attribute AstraeusNodes) that it is gone."""
        told = 0
        query = f'{contracts.OPEN_JOBS} AND {SA_NODES}="{report.node}"'
        async for run in self._client.list_workflows(query):
            try:
                await contracts.signal(self._client.get_workflow_handle(run.id), contracts.MACHINE_LOST, report)
                told += 1
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:  # it closed meanwhile: nothing left to tell
                    raise
        return told

    @implements(contracts.cancel_run_workflow)
    async def cancel_run_workflow(self, input: CancelRunInput) -> None:
        """Ask Temporal to cancel a run's workflow whose run ended Cancelled: the SDK closes a workflow Canceled only
        after such a request, and a workflow may not ask it of itself. Asking twice is harmless."""
        handle = self._client.get_workflow_handle(input.workflow_id, run_id=input.run_id)
        try:
            await handle.cancel(reason=input.reason)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:  # it closed meanwhile: nothing left to cancel
                raise

    @implements(contracts.end_run)
    async def end_run(self, input: EndRunInput) -> EndedRun:
        """A run being deleted: cancelled (workers stopped with "Run deleted") and its workflow closed."""
        return await deletion.end_run(self._client, input)

    @implements(contracts.forget_run)
    async def forget_run(self, input: ForgetRunInput) -> None:
        """A deleted run's tombstone kept; its workflow runs and logs' workflows removed from Temporal."""
        await deletion.forget_run(self._client, input)
