"""IdentityWorkflow: one certificate for one attempt of a worker, asked by the machine it is on.

A machine reaches the control plane only through Temporal. This short workflow runs the `issue_identity` activity on
the control plane's queue, which checks that the run has that attempt on that machine and signs the request with the
cluster CA. What its history holds is public: the request (a public key and the identity it names) and the
certificates. The CA's key is read by the activity, on the control plane, and never travels.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import CONTROL_TASK_QUEUE
    from workflows.messages import IssuedIdentity, IssueIdentityInput


@workflow.defn(name=contracts.IDENTITY_WORKFLOW)
class IdentityWorkflow:
    @workflow.run
    async def run(self, input: IssueIdentityInput) -> IssuedIdentity:
        issued: IssuedIdentity = await workflow.execute_activity(
            contracts.issue_identity,
            input,
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=RetryPolicy(maximum_attempts=1),  # the machine asks again, and says it waits meanwhile
            summary=f"the identity of {input.ref.task_id} (attempt {input.ref.attempt}) on {input.node}",
        )
        return issued
