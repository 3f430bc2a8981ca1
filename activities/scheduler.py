"""The scheduler service: one consistent view of the cluster, one decision pass at a time.

Runs reach it through the `place` / `release` activities, machines through `node_changed`, quotas through
`quotas_changed`. A `place` call is answered in its own result (placed now, or why it waits); what changes later
for a run is told by the `placement` signal, and lower-priority workers are stopped with `preempt`. A pass decides
without awaiting anything (so it needs no lock), and its signals leave afterwards through an outbox: in order for
each run, many runs at once, never holding up the next decision. Its view lives in memory and is rebuilt from the
open JobWorkflows, NodeWorkflows and the quotas workflow when it starts (as a Kubernetes scheduler rebuilds its
cache), so a scheduler that dies forgets nothing; runs that close without giving their room back are swept away.
The decisions are `workflows/domain/scheduling/queue.py: schedule()`, pure; this module only keeps the view and carries
the plan out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from pydantic import BaseModel
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowQueryFailedError
from temporalio.service import RPCError, RPCStatusCode

from activities import metrics
from workflows import contracts
from workflows.contracts import DRIVES_WORKFLOW_ID, PRIORITY_KEY, QUOTAS_WORKFLOW_ID, SA_NODES, implements
from workflows.domain.constraints import Drive
from workflows.domain.inventory import NodeState, NodeView
from workflows.domain.requests import Allocation, JobTaskKey, TaskRequest, allocation_for, namespace_of, run_name
from workflows.domain.run.events import MachineHeard, MachineLost, PlacementUpdate, Preempt
from workflows.domain.scheduling.machines import Compiled
from workflows.domain.scheduling.planning import TaskPlan, plan_group
from workflows.domain.scheduling.queue import Decision, Preemption, schedule
from workflows.domain.scheduling.quotas import Quota
from workflows.domain.scheduling.use import ClusterUse, cluster_use
from workflows.messages import (
    DrivesChangedInput,
    DriveUsers,
    NodeChangedInput,
    PlaceInput,
    PlaceResult,
    PlanInput,
    QuotasChangedInput,
    ReleaseInput,
    RemoveDriveRequest,
)

log = logging.getLogger(__name__)

SIGNALS_AT_ONCE = 32  # runs being signalled at once
SWEEP_SECONDS = 10.0  # how often closed runs that still hold room are looked for
RESEND_TRIES = 20  # a signal that fails is sent again, backing off to 5 s: about a minute and a half in all
# A waiting worker whose reason stays the same gets its machines' reasons again at most this often: every placement
# changes some machine's free room, and thousands of waiting runs must not each get a signal for it.
NODES_REFRESH_SECONDS = 30.0


def _utcnow() -> datetime:
    return datetime.now(UTC)


class SchedulerService:
    def __init__(self, client: Client, clock: Callable[[], datetime] = _utcnow, epoch: int = 0) -> None:
        self._client = client
        self._clock = clock
        self.epoch = epoch  # the term of the scheduler's lease this view serves (its placements are of it)
        self._stopped: str | None = None  # why it places nothing more (its lease was lost), once it does not
        self._requests: dict[JobTaskKey, TaskRequest] = {}
        self._allocations: dict[JobTaskKey, Allocation] = {}
        self._nodes: dict[str, NodeView] = {}
        self._compiled = Compiled()  # the machines compiled by the last pass, for the next
        self._quotas: dict[str, Quota] = {}
        self._drives: dict[str, Drive] = {}  # the catalogue of drives
        self._preempting: dict[JobTaskKey, JobTaskKey] = {}  # victim asked to stop -> the head worker it makes room for
        self._sent: dict[JobTaskKey, tuple[PlacementUpdate, datetime]] = {}  # the last answer each waiting worker got
        self._asking: dict[JobTaskKey, int] = {}  # workers whose `place` call awaits a pass: answered in its result
        self._refresh_at: datetime | None = None  # when a held-back refresh of machines' reasons is due
        self._due: asyncio.Future[None] | None = None  # the next pass, once a change asked for one
        self._last_pass = (0.0, 0.0)  # when the last pass ended, and how long it took (monotonic seconds)
        self._wake: asyncio.TimerHandle | None = None
        metrics.SCHEDULER.watch(self._view)
        self.outbox = Outbox(self._deliver)
        self.sweeping: asyncio.Future[None] | None = None  # sweep_forever, while the service serves

    # ---- the durable truth ------------------------------------------------------------------------------------

    async def rebuild(self) -> None:
        """Load every machine, quota and open run (its waiting and placed workers), then decide once. Runs before
        the service serves anything, so nothing changes the view meanwhile."""
        now = self._clock()
        async for wf in self._client.list_workflows(contracts.OPEN_NODES):
            view = await contracts.query(self._client.get_workflow_handle(wf.id), contracts.VIEW)
            self._set_node(view)
        self._quotas = {q.namespace: q for q in await self._read_quotas()}
        self._drives = {d.name: d for d in await self._read_drives()}
        query = contracts.OPEN_JOBS
        async for wf in self._client.list_workflows(query):
            handle = self._client.get_workflow_handle(wf.id)
            try:
                seen = await contracts.query(handle, contracts.SCHEDULER_VIEW)
            except (RPCError, WorkflowQueryFailedError) as error:
                # Created a moment ago (still being created, or ended since it was listed): a new run asks
                # for placement itself once it can.
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
        self._pass()

    async def sweep_forever(self, every: float = SWEEP_SECONDS) -> None:
        """Now and then, forget the runs that closed without giving their room back (a workflow terminated from
        the Temporal UI, or ended by a timeout): what they held is free again. Their workers, if any still run,
        are stopped by their machines."""
        while True:
            await asyncio.sleep(every)
            try:
                await self.sweep()
            except Exception:  # the next sweep tries again
                log.exception("sweeping closed runs failed")

    async def sweep(self) -> None:
        held = {key[0] for key in self._allocations} | {key[0] for key in self._requests}
        if not held:
            return
        async for wf in self._client.list_workflows(contracts.OPEN_JOBS):
            held.discard(wf.id)
        freed = False
        for job_id in sorted(held):  # not listed as open: make sure (the list may lag behind a run just started)
            try:
                described = await self._client.get_workflow_handle(job_id).describe()
            except RPCError as error:
                if error.status != RPCStatusCode.NOT_FOUND:
                    raise
            else:
                if described.status == WorkflowExecutionStatus.RUNNING:
                    continue
            freed = self._forget(job_id) or freed
        if freed:
            await self._settle()

    async def _read_quotas(self) -> list[Quota]:
        try:
            handle = self._client.get_workflow_handle(QUOTAS_WORKFLOW_ID)
            return await contracts.query(handle, contracts.QUOTAS)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return []  # no quota was ever set

    async def _read_drives(self) -> list[Drive]:
        try:
            return await contracts.query(self._client.get_workflow_handle(DRIVES_WORKFLOW_ID), contracts.DRIVES)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return []  # no drive was ever made

    def stop(self, why: str) -> None:
        """Its scheduler lost its lease: decide nothing more, and send nothing decided but not yet sent (the next
        holder rebuilds what the runs asked for and decides again). A pass asked for from now on fails, saying why."""
        self._stopped = why
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if self.sweeping is not None:
            self.sweeping.cancel()
        self.outbox.close()

    def _view(self) -> tuple[list[TaskRequest], list[Allocation], list[NodeView]]:
        return list(self._requests.values()), list(self._allocations.values()), list(self._nodes.values())

    def _set_node(self, view: NodeView) -> None:
        if view.state is NodeState.REMOVED:
            self._nodes.pop(view.name, None)
        else:
            self._nodes[view.name] = view

    # ---- activities -------------------------------------------------------------------------------------------

    @implements(contracts.place)
    async def place(self, input: PlaceInput) -> PlaceResult:
        """Take the requests into the queue and decide; the answer for each (its machine, or why it waits) is the
        call's result, so a run placed at once needs no signal. A request asked again for a worker already placed
        (a retried call) gets the same machine."""
        asked: list[TaskRequest] = []
        for request in input.requests:
            held = self._allocations.get(request.key)
            if held is not None and held.attempt == request.attempt:
                continue
            self._requests[request.key] = request
            self._sent.pop(request.key, None)
            asked.append(request)
        for request in asked:
            self._asking[request.key] = self._asking.get(request.key, 0) + 1
        try:
            if asked:
                await self._settle()
        finally:
            for request in asked:
                left = self._asking.pop(request.key) - 1
                if left:
                    self._asking[request.key] = left
        return PlaceResult(answers=[a for a in map(self._answer, input.requests) if a is not None])

    def _answer(self, request: TaskRequest) -> PlacementUpdate | None:
        """What a worker's run was last told, or is owed: its machine, or why it waits."""
        held = self._allocations.get(request.key)
        if held is not None and held.attempt == request.attempt:
            return self._placed(request, held.node)
        last = self._sent.get(request.key)
        if last is not None and last[0].attempt == request.attempt:
            return last[0]
        return None

    @implements(contracts.release)
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

    @implements(contracts.node_changed)
    async def node_changed(self, input: NodeChangedInput) -> None:
        self._set_node(input.node)
        await self._settle()

    @implements(contracts.quotas_changed)
    async def quotas_changed(self, input: QuotasChangedInput) -> None:
        self._quotas = {q.namespace: q for q in input.quotas}
        await self._settle()

    @implements(contracts.drives_changed)
    async def drives_changed(self, input: DrivesChangedInput) -> None:
        self._drives = {d.name: d for d in input.drives}
        await self._settle()

    def usage(self) -> ClusterUse:
        """Each machine's free room and each workspace's use, from this scheduler's own view (the console's pages,
        through the door): what its placements hold now, without asking any run."""
        return cluster_use(self._nodes.values(), self._allocations.values())

    @implements(contracts.drive_users)
    async def drive_users(self, input: RemoveDriveRequest) -> DriveUsers:
        """The runs whose workers wait for the drive or hold room while they mount it."""
        held = [(r.job_id, r.drives) for r in self._requests.values()]
        held += [(a.job_id, a.drives) for a in self._allocations.values()]
        runs = {f"{namespace_of(job)}/{run_name(job)}" for job, drives in held if input.name in drives}
        return DriveUsers(runs=sorted(runs))

    @implements(contracts.tell_runs_machine_lost)
    async def tell_runs_machine_lost(self, report: MachineLost) -> int:
        """Tell every open run with a worker on the machine that it is gone (its workers go Down). Returns once each
        was told, so that a lost machine's runs always learn it."""
        return await self._tell_runs_on(report.node, contracts.MACHINE_LOST.name, report)

    @implements(contracts.tell_runs_machine_heard)
    async def tell_runs_machine_heard(self, report: MachineHeard) -> int:
        """Tell every open run with a worker on the machine that its lease is late (its running workers go Stale) or
        heard again (they run on, and a new agent's watches are attached again)."""
        return await self._tell_runs_on(report.node, contracts.MACHINE_HEARD.name, report)

    async def _tell_runs_on(self, node: str, signal: str, report: BaseModel) -> int:
        """Signal every open run with a worker on `node`: the runs that hold room there, and those that list it in
        their search attribute AstraeusNodes (runs created before the scheduler answered for them); how many."""
        held = {job for (job, _), alloc in self._allocations.items() if alloc.node == node}
        query = f'{contracts.OPEN_JOBS} AND {SA_NODES}="{node}"'
        async for run in self._client.list_workflows(query):
            held.add(run.id)
        told = await asyncio.gather(*(self._tell(job, signal, report) for job in sorted(held)))
        return sum(told)

    async def _tell(self, job_id: str, name: str, message: BaseModel) -> bool:
        """One signal now; False when the run is gone (it closed meanwhile: nothing left to tell)."""
        try:
            await self._client.get_workflow_handle(job_id).signal(name, message)
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
            return False
        return True

    @implements(contracts.plan_group)
    async def plan_group(self, input: PlanInput) -> TaskPlan:
        """How many workers a group asking `total_gpus` becomes, on the machines as they are now."""
        quota = self._quotas.get(input.request.namespace)
        return plan_group(
            input.request,
            input.total_gpus,
            input.machines,
            list(self._nodes.values()),
            list(self._allocations.values()),
            self._clock(),
            pools=quota.pools if quota else (),
            drives=self._drives,
        )

    # ---- decisions --------------------------------------------------------------------------------------------

    async def _settle(self) -> None:
        """Return once a pass that saw this change is done. Every change made before that pass begins joins it,
        however many arrive meanwhile: under a burst, one pass decides many calls. A pass begins no sooner than
        its predecessor's length after that one ended, so that passes over a long queue take at most half of the
        event loop the service shares (with the control plane, in the embedded default) and batch more calls."""
        if self._due is None:
            loop = asyncio.get_running_loop()
            self._due = loop.create_future()
            rest = self._last_pass[0] + self._last_pass[1] - time.monotonic()
            if rest > 0:
                loop.call_later(rest, self._run_due)
            else:
                loop.call_soon(self._run_due)
        await asyncio.shield(self._due)

    def _run_due(self) -> None:
        due, self._due = self._due, None
        assert due is not None
        if self._stopped is not None:
            due.set_exception(RuntimeError(f"the scheduler places nothing: {self._stopped}"))
            due.exception()  # retrieved here too: a change whose caller went away must not warn
            return
        began = time.monotonic()
        try:
            self._pass()
        except Exception as error:
            log.exception("scheduling pass failed")
            due.set_exception(error)
            due.exception()  # retrieved here too: a change whose caller went away must not warn
            return
        finally:
            ended = time.monotonic()
            self._last_pass = (ended, ended - began)
            metrics.PASS_SECONDS.observe(ended - began)
        due.set_result(None)

    def _pass(self) -> None:
        """Decide for every waiting worker; tell each run what changed for it, and stop what is preempted. Nothing
        here awaits: the view changes at once, and the signals leave through the outbox afterwards."""
        now = self._clock()
        self._refresh_at = None
        plan = schedule(
            list(self._requests.values()),
            list(self._nodes.values()),
            list(self._allocations.values()),
            now,
            quotas=self._quotas,
            drives=self._drives,
            preempting=self._preempting,
            compiled=self._compiled,
        )
        for decision in plan.decisions:
            self._carry_out(decision, now)
        placed = [
            f"{d.request.job_id}/{d.request.task_id}#{d.request.attempt} on {d.node}" for d in plan.decisions if d.node
        ]
        if placed:
            log.info("epoch %d: placed %s", self.epoch, ", ".join(placed))
        for preemption in plan.preemptions:
            self._preempt(preemption)
        metrics.observe_pass(plan, now)
        self._arm_wake(min((t for t in (plan.wake_at, self._refresh_at) if t is not None), default=None))

    def _carry_out(self, decision: Decision, now: datetime) -> None:
        request = decision.request
        asking = request.key in self._asking  # its `place` call is answered in its result
        if decision.node is not None:
            self._allocations[request.key] = allocation_for(request, decision.node, now)
            self._requests.pop(request.key, None)
            self._sent.pop(request.key, None)
            if not asking:
                self.outbox.put(request.job_id, contracts.PLACEMENT.name, self._placed(request, decision.node))
            return
        assert decision.reason is not None
        reason, quota = decision.reason, decision.reached
        last = self._sent.get(request.key)
        if last is not None:
            sent, at = last
            # The same reason is not sent again; its machines' reasons at most every NODES_REFRESH_SECONDS. The
            # cheap fields first: a queue of hundreds is decided again at every pass.
            if (sent.reason, sent.quota_reached) == (reason, quota):
                due = at + timedelta(seconds=NODES_REFRESH_SECONDS)
                if now < due:
                    self._refresh_at = min(self._refresh_at or due, due)
                    return
                if (sent.attempt, sent.nodes) == (request.attempt, decision.nodes):
                    return
        update = PlacementUpdate(
            task_id=request.task_id,
            attempt=request.attempt,
            reason=reason,
            nodes=decision.nodes,
            quota_reached=quota,
        )
        self._sent[request.key] = (update, now)
        if not asking:
            self.outbox.put(request.job_id, contracts.PLACEMENT.name, update)

    def _placed(self, request: TaskRequest, node: str) -> PlacementUpdate:
        """A machine for the worker, with the address its run's other workers reach it at (a gang's leader)."""
        view = self._nodes.get(node)
        address = view.inventory.address if view is not None and view.inventory is not None else None
        return PlacementUpdate(task_id=request.task_id, attempt=request.attempt, node=node, address=address)

    def _preempt(self, preemption: Preemption) -> None:
        for task_id in preemption.task_ids:
            self._preempting[(preemption.job_id, task_id)] = preemption.head
        request = Preempt(task_ids=list(preemption.task_ids), by=preemption.by)
        log.info("preempting %s %s for %s", preemption.job_id, preemption.task_ids, preemption.head)
        self.outbox.put(preemption.job_id, contracts.PREEMPT.name, request)

    async def _deliver(self, job_id: str, name: str, message: BaseModel) -> None:
        if not await self._tell(job_id, name, message) and self._forget(job_id):
            await self._settle()

    def _forget(self, job_id: str) -> bool:
        """The run is gone (ended, terminated or deleted): forget what it asked for and held. True when that
        freed room, so that a pass decides again."""
        log.info("run %s is gone; dropping its requests", job_id)
        freed = False
        for store in (self._requests, self._allocations, self._sent, self._preempting):
            for key in [k for k in store if k[0] == job_id]:
                freed = freed or store is self._allocations
                del store[key]
        return freed

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


class Outbox:
    """Signals to runs, sent after the pass that decided them: in order for each run, `limit` runs at once. A
    signal that fails for a moment (the server is busy) is sent again, so no run misses its answer."""

    def __init__(self, send: Callable[[str, str, BaseModel], Awaitable[None]], limit: int = SIGNALS_AT_ONCE) -> None:
        self._send = send
        self._limit = limit
        self._queues: dict[str, list[tuple[str, BaseModel]]] = {}  # by run, in the order decided
        self._gate: asyncio.Semaphore | None = None
        self._drains: set[asyncio.Task[None]] = set()
        self._closed = False

    def close(self) -> None:
        """Send nothing more: what waits is dropped, what is being sent is cancelled."""
        self._closed = True
        for drain in list(self._drains):
            drain.cancel()
        self._queues.clear()

    def put(self, job_id: str, name: str, message: BaseModel) -> None:
        if self._closed:
            return
        queue = self._queues.get(job_id)
        if queue is not None:
            queue.append((name, message))  # its drain is running: it sends this one after the others
            return
        self._queues[job_id] = [(name, message)]
        drain = asyncio.ensure_future(self._drain(job_id))
        self._drains.add(drain)
        drain.add_done_callback(self._drains.discard)

    async def idle(self) -> None:
        """Return once every signal put so far was sent (or given up)."""
        while self._drains:
            await asyncio.gather(*self._drains, return_exceptions=True)

    async def _drain(self, job_id: str) -> None:
        if self._gate is None:
            self._gate = asyncio.Semaphore(self._limit)
        async with self._gate:
            queue = self._queues.get(job_id, [])
            while queue:
                name, message = queue[0]
                await self._send_patiently(job_id, name, message)
                queue.pop(0)
            self._queues.pop(job_id, None)

    async def _send_patiently(self, job_id: str, name: str, message: BaseModel) -> None:
        delay = 0.1
        for _ in range(RESEND_TRIES):
            try:
                await self._send(job_id, name, message)
                return
            except Exception as error:
                log.warning("signal %s to %s failed (sent again in %.1f s): %s", name, job_id, delay, error)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        log.error(
            "signal %s to %s given up after %d tries; the run asks again when it restarts", name, job_id, RESEND_TRIES
        )


def _placement(decision: Decision) -> str:
    request = decision.request
    return f"{request.job_id} {request.task_id}#{request.attempt} on {decision.node}"


def _restored(alloc: Allocation, priority: int | None, now: datetime) -> Allocation:
    """A placed worker read back from its run: its run's priority (from the search attribute) when the run did
    not say it, and a start no later than now, so that estimates do not move with the clock."""
    changes: dict[str, object] = {}
    if priority is not None and alloc.priority == 0:
        changes["priority"] = priority
    if alloc.started_at is None:
        changes["started_at"] = now
    return alloc.model_copy(update=changes) if changes else alloc
