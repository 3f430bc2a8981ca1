"""Namespace (workspace) quotas: how much of the cluster a namespace may hold at once, and the machines it may use.

A worker over its namespace's quota waits ("Waits for namespace quota: gpus 6 in use + 4 asked > 8"); waiting on
quota never blocks other namespaces. A worker that asks more than the quota allows at all says so; either way its
run's history gets "Quota reached: <why>" the first time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from workflows.domain.group_parts import Name
from workflows.domain.reasons import R, Reason, number
from workflows.domain.requests import Allocation, TaskRequest

RESOURCES = ("gpus", "cpu", "memory_bytes")


class Quota(BaseModel):
    """One namespace's limits; None is no limit. `pools`: the only pools whose machines it may use (empty: all)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: Name
    gpus: int | None = Field(None, ge=0)
    cpu: float | None = Field(None, ge=0)
    memory_bytes: int | None = Field(None, ge=0)
    pools: tuple[str, ...] = ()

    def limit(self, resource: str) -> float | None:
        value: float | None = getattr(self, resource)
        return value


@dataclass
class Usage:
    gpus: int = 0
    cpu: float = 0.0
    memory_bytes: int = 0

    def get(self, resource: str) -> float:
        value: float = getattr(self, resource)
        return value

    def add(self, other: Usage | TaskRequest | Allocation, sign: int = 1) -> None:
        self.gpus += sign * other.gpus
        self.cpu += sign * other.cpu
        self.memory_bytes += sign * other.memory_bytes


@dataclass(frozen=True)
class QuotaWait:
    """Why a worker waits on its quota, and the entry its run's history gets ("Quota reached: <why>")."""

    reason: Reason
    reached: Reason


def usage_by_namespace(allocations: Iterable[Allocation]) -> dict[str, Usage]:
    usage: dict[str, Usage] = defaultdict(Usage)
    for alloc in allocations:
        usage[alloc.namespace].add(alloc)
    return usage


def check_quota(quota: Quota | None, used: Usage, asked: Usage, gang: bool = False) -> QuotaWait | None:
    """None when `asked` fits within the quota next to `used`. A resource asked beyond the quota on its own is
    reported first (no wait will help), then the first resource that the namespace's other work holds."""
    if quota is None:
        return None
    for resource in RESOURCES:
        limit, wanted = quota.limit(resource), asked.get(resource)
        if limit is not None and wanted > limit:
            why = f"{resource} {number(wanted)} asked > {number(limit)}"
            return QuotaWait(R.QuotaNeverEnough(why=why), R.QuotaReached(why=why))
    for resource in RESOURCES:
        limit, wanted, held = quota.limit(resource), asked.get(resource), used.get(resource)
        if limit is not None and wanted > 0 and held + wanted > limit:
            values = {"resource": resource, "used": number(held), "asked": number(wanted), "limit": number(limit)}
            template = R.GangWaitsForQuota if gang else R.WaitsForQuota
            why = f"{resource} {values['used']} in use + {values['asked']} asked > {values['limit']}"
            return QuotaWait(template(**values), R.QuotaReached(why=why))
    return None
