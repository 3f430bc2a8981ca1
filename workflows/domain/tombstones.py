"""Deleted runs: what is kept of a run once it is deleted (its tombstone), so that the runs list can still show it
as Deleted, and a machine that was down during the delete knows, when it comes back, whose files to remove."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from workflows.domain.group_parts import Name

DELETED = "Deleted"  # how the runs list shows a deleted run (not a state any run holds)
KEPT_TOMBSTONES = 5000  # the newest kept; an older one is forgotten (its run's name was free long since)


class Tombstone(BaseModel):
    """A deleted run: its namespace and name, the workflow run it was (`run_id`: Temporal's latest run of it, which
    tells it apart from a later run given the same name), who deleted it and when, and what it was last."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: Name
    name: Name
    run_id: str
    deleted_by: str = Field(max_length=256)
    deleted_at: datetime
    created_at: datetime | None = None
    last_state: str
    last_reason: str = ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.namespace, self.name, self.run_id)


def with_tombstone(kept: list[Tombstone], added: Tombstone, limit: int = KEPT_TOMBSTONES) -> list[Tombstone]:
    """The tombstones once `added` is kept (again: the same run's is replaced), oldest first, the newest `limit`."""
    others = [t for t in kept if t.key != added.key]
    return sorted([*others, added], key=lambda t: (t.deleted_at, t.key))[-limit:]


def matching(kept: list[Tombstone], namespace: str | None, runs: list[tuple[str, str]] | None) -> list[Tombstone]:
    """The tombstones of a namespace (None: every one), of the runs named (namespace, name) when `runs` is given;
    newest first."""
    wanted = None if runs is None else set(runs)
    found = [
        t
        for t in kept
        if (namespace is None or t.namespace == namespace) and (wanted is None or (t.namespace, t.name) in wanted)
    ]
    return found[::-1]
