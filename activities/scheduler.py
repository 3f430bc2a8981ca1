"""The scheduler service: one consistent view of the cluster, one decision pass at a time.

Runs reach it through the `place` / `release` activities, machines through `node_changed`; it answers runs with
the `placement` signal. Its view lives in memory and is rebuilt from the open JobWorkflows and NodeWorkflows when
it starts (as a Kubernetes scheduler rebuilds its cache), so a scheduler that dies forgets nothing.
"""

from __future__ import annotations

import asyncio
import logging

from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from workflows.domain.job import PlacementUpdate
from workflows.domain.nodes import NodeView
from workflows.domain.placement import Allocation, Decision, TaskRequest, place
from workflows.messages import NodeChangedInput, PlaceInput, ReleaseInput, SchedulerView

log = logging.getLogger(__name__)

Key = tuple[str, str]


class SchedulerService:
    def __init__(self, client: Client) -> None:
        self._client = client
        self._requests: dict[Key, TaskRequest] = {}
        self._allocations: dict[Key, Allocation] = {}
        self._nodes: dict[str, NodeView] = {}
        self._sent: dict[Key, PlacementUpdate] = {}  # the last answer each waiting worker got
        self._lock = asyncio.Lock()  # one pass at a time: decisions must see each other's effects

    # ---- the durable truth ------------------------------------------------------------------------------------

    async def rebuild(self) -> None:
        """Load every open run's requests and allocations and every machine's view, then decide once."""
        async with self._lock:
            async for wf in self._client.list_workflows('WorkflowType="NodeWorkflow" AND ExecutionStatus="Running"'):
                view = await self._client.get_workflow_handle(wf.id).query("view", result_type=NodeView)
                self._nodes[view.name] = view
            async for wf in self._client.list_workflows('WorkflowType="JobWorkflow" AND ExecutionStatus="Running"'):
                handle = self._client.get_workflow_handle(wf.id)
                try:
                    seen = await handle.query("scheduler_view", result_type=SchedulerView)
                except RPCError as error:  # created a moment ago: it asks for placement itself
                    log.info("rebuild: %s not readable yet: %s", wf.id, error)
                    continue
                self._requests.update({r.key: r for r in seen.pending})
                self._allocations.update({a.key: a for a in seen.placed})
            log.info(
                "rebuilt: %d machines, %d waiting, %d placed",
                len(self._nodes),
                len(self._requests),
                len(self._allocations),
            )
            await self._pass()

    # ---- activities -------------------------------------------------------------------------------------------

    @activity.defn(name="place")
    async def place(self, input: PlaceInput) -> None:
        async with self._lock:
            for request in input.requests:
                held = self._allocations.get(request.key)
                if held is not None and held.attempt == request.attempt:
                    # Asked again for a worker already placed (a retried call): answer the same.
                    await self._signal(request.job_id, PlacementUpdate(**_ids(request), node=held.node))
                    continue
                self._requests[request.key] = request
                self._sent.pop(request.key, None)
            await self._pass()

    @activity.defn(name="release")
    async def release(self, input: ReleaseInput) -> None:
        async with self._lock:
            key = (input.job_id, input.task_id)
            held = self._allocations.get(key)
            if held is not None and held.attempt <= input.attempt:
                del self._allocations[key]
            waiting = self._requests.get(key)
            if waiting is not None and waiting.attempt <= input.attempt:
                del self._requests[key]
                self._sent.pop(key, None)
            await self._pass()

    @activity.defn(name="node_changed")
    async def node_changed(self, input: NodeChangedInput) -> None:
        async with self._lock:
            self._nodes[input.node.name] = input.node
            await self._pass()

    # ---- decisions --------------------------------------------------------------------------------------------

    async def _pass(self) -> None:
        """Decide for every waiting worker; tell each run what changed for it."""
        decisions = place(list(self._requests.values()), list(self._nodes.values()), self._allocations.values())
        for decision in decisions:
            await self._carry_out(decision)

    async def _carry_out(self, decision: Decision) -> None:
        request = decision.request
        if request.key not in self._requests:
            return  # its run was dropped earlier in this pass
        if decision.node is not None:
            self._allocations[request.key] = Allocation(
                job_id=request.job_id,
                task_id=request.task_id,
                attempt=request.attempt,
                node=decision.node,
                cpu=request.cpu,
                memory_bytes=request.memory_bytes,
                gpus=request.gpus,
            )
            del self._requests[request.key]
            self._sent.pop(request.key, None)
            await self._signal(request.job_id, PlacementUpdate(**_ids(request), node=decision.node))
            return
        assert decision.reason is not None
        update = PlacementUpdate(
            **_ids(request), code=decision.reason.code, reason=decision.reason.text, nodes=decision.nodes
        )
        if self._sent.get(request.key) != update:
            self._sent[request.key] = update
            await self._signal(request.job_id, update)

    async def _signal(self, job_id: str, update: PlacementUpdate) -> None:
        handle: WorkflowHandle[object, object] = self._client.get_workflow_handle(job_id)
        try:
            await handle.signal("placement", update)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            # The run is gone (ended or deleted): forget what it asked for and held.
            log.info("run %s is gone; dropping its requests", job_id)
            for store in (self._requests, self._allocations, self._sent):
                for key in [k for k in store if k[0] == job_id]:
                    del store[key]


def _ids(request: TaskRequest) -> dict[str, object]:
    return {"task_id": request.task_id, "attempt": request.attempt}
