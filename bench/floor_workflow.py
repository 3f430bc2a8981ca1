"""The floor's bare workflow: three no-op activities in sequence, nothing else (sandbox-safe: temporalio only)."""

from __future__ import annotations

from datetime import timedelta

from temporalio import activity, workflow

FLOOR_TASK_QUEUE = "bench-floor"
ACTIVITIES = 3


@activity.defn
async def noop() -> None:
    """Does nothing: what is measured is the engine's round trip."""


@workflow.defn
class FloorWorkflow:
    @workflow.run
    async def run(self) -> None:
        for _ in range(ACTIVITIES):
            await workflow.execute_activity(noop, start_to_close_timeout=timedelta(seconds=30))
