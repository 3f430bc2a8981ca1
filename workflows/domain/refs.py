"""How one attempt of one worker is named, by its run and by its machine alike (one key, on the wire as in memory)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class TaskRef(BaseModel):
    """One attempt of one worker: how a run names it to its machine, and how the machine keeps it. A retried start
    finds its own container by it (`slug`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    namespace: str
    job: str
    task_id: str
    attempt: int

    @property
    def slug(self) -> str:
        """`namespace.job.task.attempt`: the attempt's name on its machine (container, directory, files)."""
        return f"{self.namespace}.{self.job}.{self.task_id}.{self.attempt}"

    def ids(self) -> dict[str, Any]:
        """The fields that name the attempt in a report to its run."""
        return {"task_id": self.task_id, "attempt": self.attempt}
