"""The node agent's activities: hold the machine's lease, and start, supervise and stop its workers.

Every activity is idempotent: an attempt's container is named by run, worker and attempt, so a retried start
finds its own, and a supervisor that restarts re-attaches to a worker that kept running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.runtime.base import Launch, Runtime, RuntimeFailure, TaskKey
from workflows.domain.nodes import NodeInventory
from workflows.domain.reasons import R
from workflows.domain.spec import job_id
from workflows.messages import (
    LeaseInput,
    StartTaskInput,
    StartTaskResult,
    StopTaskInput,
    SuperviseInput,
    TaskExit,
    TaskRef,
    TaskReport,
)

T = TypeVar("T")
POLL_SECONDS = 0.25


def task_key(ref: TaskRef) -> TaskKey:
    return TaskKey(namespace=ref.namespace, job=ref.job, task=ref.task_id, attempt=ref.attempt)


class AgentActivities:
    def __init__(self, client: Client, inventory: NodeInventory, runtime: Runtime) -> None:
        self._client = client
        self._inventory = inventory
        self._runtime = runtime
        self._admission = asyncio.Lock()  # GPUs are chosen and taken in one step

    @activity.defn(name="hold_lease")
    async def hold_lease(self, input: LeaseInput) -> None:
        """Renew the machine's lease by heartbeating until the control plane cancels it."""
        while True:
            activity.heartbeat()
            await asyncio.sleep(input.renew_seconds)

    @activity.defn(name="start_task")
    async def start_task(self, input: StartTaskInput) -> StartTaskResult:
        """Start one attempt within the machine's real free GPUs; a retry finds the attempt it started."""
        key = task_key(input.ref)
        group = input.group
        async with self._admission:
            in_use = await asyncio.to_thread(self._runtime.gpus_in_use)
            if key.slug in in_use:
                return StartTaskResult(gpu_indices=in_use[key.slug])
            taken = {index for indices in in_use.values() for index in indices}
            free = [gpu.index for gpu in self._inventory.gpus if gpu.index not in taken]
            if group.gpus > len(free):
                reason = R.ContainerStartFailed(error=f"needs {group.gpus} GPUs, {len(free)} free on this machine")
                raise ApplicationError(reason.text, type=reason.code, non_retryable=True)
            gpus = free[: group.gpus]
            env = {
                **group.env,
                "ASTRAEUS_NODE": self._inventory.name,
                "ASTRAEUS_GROUP": group.name,
            }
            launch = Launch(
                command=group.command,
                env=env,
                image=group.image,
                gpu_indices=gpus,
                cpu=group.cpu,
                memory_bytes=group.memory_bytes,
            )
            try:
                await asyncio.to_thread(self._runtime.start, key, launch)
            except RuntimeFailure as failure:
                raise ApplicationError(failure.reason.text, type=failure.reason.code, non_retryable=True) from None
        return StartTaskResult(gpu_indices=gpus)

    @activity.defn(name="supervise_task")
    async def supervise_task(self, input: SuperviseInput) -> TaskExit:
        """Report the worker running, then watch it until it ends, heartbeating all along."""
        key = task_key(input.ref)
        observed = await asyncio.to_thread(self._runtime.observe, key)
        if observed.not_found:
            return TaskExit(not_found=True)
        details = activity.info().heartbeat_details
        if not details:  # the first supervisor of this attempt tells the run it runs
            handle = self._client.get_workflow_handle(job_id(input.ref.namespace, input.ref.job))
            await handle.signal("task_running", TaskReport(task_id=input.ref.task_id, attempt=input.ref.attempt))
        while observed.running:
            activity.heartbeat("reported")
            await asyncio.sleep(POLL_SECONDS)
            observed = await asyncio.to_thread(self._runtime.observe, key)
        if observed.not_found:
            return TaskExit(not_found=True)
        tail = await asyncio.to_thread(
            self._runtime.log_tail, key, input.settings.log_tail_lines, input.settings.log_tail_bytes
        )
        return TaskExit(exit_code=observed.exit_code, oom=observed.oom, log_tail=tail)

    @activity.defn(name="stop_task")
    async def stop_task(self, input: StopTaskInput) -> None:
        """The stop signal, the grace period, then a kill; returns once the worker has ended."""
        key = task_key(input.ref)
        await _heartbeating(asyncio.to_thread(self._runtime.stop, key, input.grace_seconds))


async def _heartbeating(work: Awaitable[T]) -> T:
    """Await `work` while heartbeating, so a long stop is not mistaken for a dead agent."""

    async def beat() -> None:
        while True:
            activity.heartbeat()
            await asyncio.sleep(1)

    beater = asyncio.ensure_future(beat())
    try:
        return await work
    finally:
        beater.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beater
