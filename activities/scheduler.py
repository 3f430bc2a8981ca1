"""The scheduler service: one consistent view of the cluster, one decision pass at a time.

Runs reach it through the `place` / `release` activities, machines through `node_changed`, quotas through
`quotas_changed`; it answers runs with the `placement` signal and stops lower-priority workers with `preempt`. Its
view lives in memory and is rebuilt from the open JobWorkflows, NodeWorkflows and the quotas workflow when it
starts (as a Kubernetes scheduler rebuilds its cache), so a scheduler that dies forgets nothing. The decisions are
`workflows/domain/scheduling.py: schedule()`, pure; this module only keeps the view and carries the plan out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel
from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.common import SearchAttributeKey
from temporalio.service import RPCError, RPCStatusCode

from workflows.domain.nodes import NodeState, NodeView
from workflows.domain.planning import WorkerPlan, plan_workers
from workflows.domain.quotas import Quota
from workflows.domain.requests import Allocation, TaskRequest, allocation_for
from workflows.domain.scheduling import Decision, Preemption, schedule
from workflows.messages import (
    QUOTAS_WORKFLOW_ID,
    SA_PRIORITY,
    NodeChangedInput,
    PlaceInput,
    PlacementAnswer,
    PlanInput,
    PreemptRequest,
    QuotasChangedInput,
    ReleaseInput,
    SchedulerView,
)

log = logging.getLogger(__name__)

Key = tuple[str, str]
PRIORITY_KEY = SearchAttributeKey.for_int(SA_PRIORITY)
SIGNALS_AT_ONCE = 32  # signals of one pass in flight together
# A waiting worker whose reason stays the same gets its machines' reasons again at most this often: every placement
# changes some machine's free room, and thousands of waiting runs must not each get a signal for it.
NODES_REFRESH_SECONDS = 30.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


class SchedulerService:
    def __init__(self, client: Client, clock: Callable[[], datetime] = _utcnow) -> None:
        self._client = client
        self._clock = clock
        self._requests: dict[Key, TaskRequest] = {}
        self._allocations: dict[Key, Allocation] = {}
        self._nodes: dict[str, NodeView] = {}
        self._quotas: dict[str, Quota] = {}
        self._preempting: dict[Key, Key] = {}  # victim asked to stop -> the head worker it makes room for
        self._sent: dict[Key, tuple[PlacementAnswer, datetime]] = {}  # the last answer each waiting worker got
        self._refresh_at: datetime | None = None  # when a held-back refresh of machines' reasons is due
        self._lock = asyncio.Lock()  # one pass at a time: decisions must see each other's effects
        self._changes = 0  # changes made to the view
        self._decided = 0  # changes the last pass began with
        self._wake: asyncio.TimerHandle | None = None

    # ---- the durable truth ------------------------------------------------------------------------------------

    async def rebuild(self) -> None:
        """Load every machine, quota and open run (its waiting and placed workers), then decide once."""
        async with self._lock:
            now = self._clock()
            async for wf in self._client.list_workflows('WorkflowType="NodeWorkflow" AND ExecutionStatus="Running"'):
                view = await self._client.get_workflow_handle(wf.id).query("view", result_type=NodeView)
                self._set_node(view)
            self._quotas = {q.namespace: q for q in await self._read_quotas()}
            query = 'WorkflowType="JobWorkflow" AND ExecutionStatus="Running"'
            async for wf in self._client.list_workflows(query):
                handle = self._client.get_workflow_handle(wf.id)
                try:
                    seen = await handle.query("scheduler_view", result_type=SchedulerView)
                except RPCError as error:  # created a moment ago: it asks for placement itself
                    log.info("rebuild: %s not readable yet: %s", wf.id, error)
                    continue
                priority = wf.typed_search_attributes.get(PRIORITY_KEY)
                self._requests.update({r.key: r for r in seen.pending})
                for alloc in seen.placed:
                    self._allocations[alloc.key] = _restored(alloc, priority, now)
            log.info(
                "rebuilt: %d machines, %d quotas, %d waiting, %d placed",
                len(self._nodes),
                len(self._quotas),
                len(self._requests),
                len(self._allocations),
            )
            await self._pass()

    async def _read_quotas(self) -> list[Quota]:
        try:
            handle = self._client.get_workflow_handle(QUOTAS_WORKFLOW_ID)
            return await handle.query("quotas", result_type=list[Quota])  # type: ignore[no-any-return]
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return []  # no quota was ever set

    def _set_node(self, view: NodeView) -> None:
        if view.state is NodeState.REMOVED:
            self._nodes.pop(view.name, None)
        else:
            self._nodes[view.name] = view

    # ---- activities -------------------------------------------------------------------------------------------

    @activity.defn(name="place")
    async def place(self, input: PlaceInput) -> None:
        again: list[Awaitable[None]] = []
        for request in input.requests:
            held = self._allocations.get(request.key)
            if held is not None and held.attempt == request.attempt:
                # Asked again for a worker already placed (a retried call): answer the same.
                again.append(self._signal(request.job_id, "placement", self._placed(request, held.node)))
                continue
            self._requests[request.key] = request
            self._sent.pop(request.key, None)
        await _bounded(again)
        await self._settle()

    @activity.defn(name="release")
    async def release(self, input: ReleaseInput) -> None:
        key = (input.job_id, input.task_id)
        held = self._allocations.get(key)
        if held is not None and held.attempt <= input.attempt:
            del self._allocations[key]
            self._preempting.pop(key, None)
        waiting = self._requests.get(key)
        if waiting is not None and waiting.attempt <= input.attempt:
            del self._requests[key]
            self._sent.pop(key, None)
        await self._settle()

    @activity.defn(name="node_changed")
    async def node_changed(self, input: NodeChangedInput) -> None:
        self._set_node(input.node)
        await self._settle()

    @activity.defn(name="quotas_changed")
    async def quotas_changed(self, input: QuotasChangedInput) -> None:
        self._quotas = {q.namespace: q for q in input.quotas}
        await self._settle()

    @activity.defn(name="plan_workers")
    async def plan_workers(self, input: PlanInput) -> WorkerPlan:
        """How many workers a group asking `total_gpus` becomes, on the machines as they are now."""
        quota = self._quotas.get(input.request.namespace)
        return plan_workers(
            input.request,
            input.total_gpus,
            input.machines,
            list(self._nodes.values()),
            list(self._allocations.values()),
            self._clock(),
            pools=quota.pools if quota else (),
        )

    # ---- decisions --------------------------------------------------------------------------------------------

    async def _settle(self) -> None:
        """Return once a pass that saw every change made so far is done. Changes wait for the pass in progress
        and are then decided by one pass together, however many arrived meanwhile."""
        self._changes += 1
        target = self._changes
        async with self._lock:
            if self._decided >= target:
                return  # a pass that began after this change has decided it
            self._decided = self._changes
            await self._pass()

    async def _pass(self) -> None:
        """Decide for every waiting worker; tell each run what changed for it, and stop what is preempted. The view
        changes before the first await, so a change made while signals are in flight is the next pass's."""
        now = self._clock()
        self._refresh_at = None
        plan = schedule(
            list(self._requests.values()),
            list(self._nodes.values()),
            list(self._allocations.values()),
            now,
            quotas=self._quotas,
            preempting=self._preempting,
        )
        effects: list[Awaitable[None]] = []
        for decision in plan.decisions:
            effect = self._carry_out(decision, now)
            if effect is not None:
                effects.append(effect)
        for preemption in plan.preemptions:
            effects.append(self._preempt(preemption))
        await _bounded(effects)
        self._arm_wake(min((t for t in (plan.wake_at, self._refresh_at) if t is not None), default=None))

    def _carry_out(self, decision: Decision, now: datetime) -> Awaitable[None] | None:
        request = decision.request
        if decision.node is not None:
            self._allocations[request.key] = allocation_for(request, decision.node, now)
            self._requests.pop(request.key, None)
            self._sent.pop(request.key, None)
            return self._signal(request.job_id, "placement", self._placed(request, decision.node))
        assert decision.reason is not None
        update = PlacementAnswer(
            task_id=request.task_id,
            attempt=request.attempt,
            code=decision.reason.code,
            reason=decision.reason.text,
            nodes=decision.nodes,
            quota_reached=decision.reached.text if decision.reached is not None else "",
        )
        last = self._sent.get(request.key)
        if last is not None:
            sent, at = last
            if sent == update:
                return None
            due = at + timedelta(seconds=NODES_REFRESH_SECONDS)
            if (sent.code, sent.reason) == (update.code, update.reason) and now < due:
                self._refresh_at = min(self._refresh_at or due, due)
                return None
        self._sent[request.key] = (update, now)
        return self._signal(request.job_id, "placement", update)

    def _placed(self, request: TaskRequest, node: str) -> PlacementAnswer:
        """A machine for the worker, with the address its run's other workers reach it at (a gang's leader)."""
        view = self._nodes.get(node)
        address = view.inventory.address if view is not None and view.inventory is not None else None
        return PlacementAnswer(task_id=request.task_id, attempt=request.attempt, node=node, address=address)

    def _preempt(self, preemption: Preemption) -> Awaitable[None]:
        for task_id in preemption.task_ids:
            self._preempting[(preemption.job_id, task_id)] = preemption.head
        request = PreemptRequest(task_ids=list(preemption.task_ids), by=preemption.by)
        log.info("preempting %s %s for %s", preemption.job_id, preemption.task_ids, preemption.head)
        return self._signal(preemption.job_id, "preempt", request)

    async def _signal(self, job_id: str, name: str, message: BaseModel) -> None:
        handle: WorkflowHandle[object, object] = self._client.get_workflow_handle(job_id)
        try:
            await handle.signal(name, message)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            # The run is gone (ended or deleted): forget what it asked for and held.
            log.info("run %s is gone; dropping its requests", job_id)
            for store in (self._requests, self._allocations, self._sent, self._preempting):
                for key in [k for k in store if k[0] == job_id]:
                    del store[key]

    def _arm_wake(self, at: datetime | None) -> None:
        """Decide again when a patience window moves or held-back reasons are due, even if nothing happens."""
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if at is None:
            return
        delay = max((at - self._clock()).total_seconds(), 0.05)
        loop = asyncio.get_running_loop()
        self._wake = loop.call_later(delay, lambda: loop.create_task(self._woken()))

    async def _woken(self) -> None:
        try:
            await self._settle()
        except Exception:  # the next event decides again; a timer has no caller to retry it
            log.exception("scheduling pass on wake-up failed")


async def _bounded(effects: list[Awaitable[None]]) -> None:
    gate = asyncio.Semaphore(SIGNALS_AT_ONCE)

    async def one(effect: Awaitable[None]) -> None:
        async with gate:
            await effect

    await asyncio.gather(*(one(e) for e in effects))


def _restored(alloc: Allocation, priority: int | None, now: datetime) -> Allocation:
    """A placed worker read back from its run: its run's priority (from the search attribute) when the run did
    not say it, and a start no later than now, so that estimates do not move with the clock."""
    changes: dict[str, object] = {}
    if priority is not None and alloc.priority == 0:
        changes["priority"] = priority
    if alloc.started_at is None:
        changes["started_at"] = now
    return alloc.model_copy(update=changes) if changes else alloc
