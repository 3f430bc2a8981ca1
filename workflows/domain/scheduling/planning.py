"""Planning: a group that asks for GPUs across machines becomes workers, one per machine, each with the same
power-of-2 number of GPUs; when that cannot be done, "Cannot plan workers: <why>" (the run looks again every 60 s).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from workflows.domain.bounds import MAX_WORKERS
from workflows.domain.constraints import Drive
from workflows.domain.inventory import NodeView
from workflows.domain.reasons import R, Reason
from workflows.domain.requests import Allocation, TaskRequest
from workflows.domain.scheduling.machines import Cluster
from workflows.domain.scheduling.placement import Ask, explain, usable_gpus

_ROOM_FOR_GPUS = frozenset({R.InsufficientGpus.code, R.HealthyGpus.code})


class TaskPlan(BaseModel):
    """`workers` workers of `gpus_per_worker` GPUs each, or (workers 0) why not: `reason` is the whole
    "Cannot plan workers: <why>" sentence."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    workers: int = 0
    gpus_per_worker: int = 0
    code: str = ""
    reason: str = ""

    @classmethod
    def cannot(cls, why: Reason) -> TaskPlan:
        reason = R.CannotPlanWorkers(why=why.text)
        return cls(code=why.code, reason=reason.text)


def power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _room(cluster: Cluster, template: TaskRequest, names: Iterable[str], drives: Mapping[str, Drive]) -> list[int]:
    """For each machine that could host a worker of the group but for its GPU count, the GPUs it could use now."""
    gpus = max(template.gpus, 1)
    per_gpu = template.memory_per_gpu_bytes  # memory that scales with the GPUs bounds them too
    probe = template.model_copy(
        update={"gpus": gpus, "memory_bytes": per_gpu * gpus if per_gpu else template.memory_bytes}
    )
    ask = Ask(probe, drives=drives)
    room = []
    for name in names:
        machine, free = cluster.machines[name], cluster.free[name]
        if all(reason.code in _ROOM_FOR_GPUS for reason in explain(machine, free, ask)):
            usable = usable_gpus(machine, free, probe)[0]
            room.append(min(usable, free.memory_bytes // per_gpu) if per_gpu else usable)
    return room


def plan_group(
    template: TaskRequest,
    total_gpus: int,
    machines: int | None,
    nodes: Sequence[NodeView],
    allocations: Iterable[Allocation],
    now: datetime,
    pools: Sequence[str] = (),
    drives: Mapping[str, Drive] | None = None,
) -> TaskPlan:
    """Split `total_gpus` of the group `template.group` into workers on the machines as they are now: across
    exactly `machines` machines when given, else across as few as will take them (at most the run's
    topology.max_machines). `template` is one worker of the group with everything but its GPU count; `drives` is the
    cluster's catalogue, for a group that mounts some."""
    if machines is not None:
        if total_gpus % machines:
            return TaskPlan.cannot(R.PlanUneven(gpus=total_gpus, machines=machines))
        per = total_gpus // machines
        if not power_of_two(per):
            return TaskPlan.cannot(R.PlanNotPowerOfTwo(gpus=total_gpus, machines=machines, per=per))
    cluster = Cluster(nodes, allocations, now)
    allowed = set(pools)
    names = [n for n in cluster.names if not allowed or cluster.machines[n].pools & allowed]
    room = _room(cluster, template, names, drives or {})
    if not room:
        return TaskPlan.cannot(R.PlanNoHost(group=template.group))
    largest = max(room)
    if machines is not None:
        counts = [machines]
    else:
        most = template.topology.max_machines if template.topology and template.topology.max_machines else total_gpus
        # A run has at most MAX_WORKERS workers (workflows/domain/bounds.py): a split into more is no way to run it.
        counts = [w for w in range(1, min(most, total_gpus, MAX_WORKERS) + 1) if total_gpus % w == 0]
    for workers in counts:
        per = total_gpus // workers
        if power_of_two(per) and sum(r >= per for r in room) >= workers:
            return TaskPlan(workers=workers, gpus_per_worker=per)
    return TaskPlan.cannot(R.PlanNoWay(gpus=total_gpus, free=largest))
