"""LogsWorkflow: reads a worker's output on the machine that ran it, for `astraeus logs RUN/TASK`.

A client cannot call an agent directly: it reaches machines only through Temporal. This short workflow runs the
`read_log` activity on the machine's own task queue and returns the text. It gives up quickly when the machine does
not answer (`answer_within_seconds`), since a person is waiting.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from workflows import contracts
    from workflows.contracts import node_task_queue
    from workflows.messages import LogsInput, LogText


@workflow.defn(name=contracts.LOGS_WORKFLOW)
class LogsWorkflow:
    @workflow.run
    async def run(self, input: LogsInput) -> LogText:
        text: LogText = await workflow.execute_activity(
            contracts.read_log,
            input.read,
            task_queue=node_task_queue(input.node),
            schedule_to_close_timeout=timedelta(seconds=input.answer_within_seconds),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=2)),
            summary=f"read the log of {input.read.ref.task_id} on {input.node}",
        )
        return text
