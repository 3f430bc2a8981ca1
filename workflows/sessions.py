"""SessionWorkflow: a person's interactive session with a running worker, one request at a time, on its machine.

`astraeus interactive-token` grants a token's public key for one attempt (`grant_session`), and `astraeus attach`
runs a command in it (`attach_session`), each as this short workflow running the activity on the machine's own task
queue, as LogsWorkflow reads a log. Its history holds the public key and signed requests, never the token. A command
is run at most once: its activity is not retried, since running it again could do its effect twice.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import node_task_queue
    from workflows.messages import SessionInput, SessionOutput


@workflow.defn(name=contracts.SESSION_WORKFLOW)
class SessionWorkflow:
    @workflow.run
    async def run(self, input: SessionInput) -> SessionOutput:
        answer_within = timedelta(seconds=input.answer_within_seconds)
        if input.grant is not None:
            granted = await workflow.execute_activity(
                contracts.grant_session,
                input.grant,
                task_queue=node_task_queue(input.node),
                schedule_to_close_timeout=answer_within,
                retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=2)),
                summary=f"grant a session with {input.grant.ref.task_id} on {input.node}",
            )
            return SessionOutput(granted=granted)
        assert input.attach is not None  # SessionInput holds one of the two
        attached = await workflow.execute_activity(
            contracts.attach_session,
            input.attach,
            task_queue=node_task_queue(input.node),
            schedule_to_start_timeout=answer_within,
            start_to_close_timeout=timedelta(seconds=input.attach.timeout_seconds + 10),
            retry_policy=RetryPolicy(maximum_attempts=1),
            summary=f"run {input.attach.argv[0]} in {input.attach.ref.task_id} on {input.node}",
        )
        return SessionOutput(attached=attached)
