"""Machines (the API says nodes): what each one has, and whether it takes work."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class NodeState(StrEnum):
    READY = "Ready"
    DOWN = "Down"


class GpuInfo(BaseModel):
    """One GPU as the machine's NVML (or its declaration) reports it, with its health: healthy, at risk (fit
    for work that does not ask for healthy GPUs only), or faulted (the machine takes no GPU work)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    uuid: str
    model: str
    memory_bytes: int
    fault: str | None = Field(None, description='A fatal fault, e.g. "Xid 79 (GPU has fallen off the bus)".')
    at_risk: str | None = Field(None, description='Why it may fail soon, e.g. "retired pages pending".')

    @property
    def healthy(self) -> bool:
        return self.fault is None and self.at_risk is None


class NodeInventory(BaseModel):
    """What a machine has; the agent reports it when it registers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    cpus: float = Field(ge=0)
    memory_bytes: int = Field(ge=0)
    gpus: list[GpuInfo] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    gpu_source: str = "declared"


class NodeStatusEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    state: str
    reason: str
    at: datetime


class NodeView(BaseModel):
    """A machine as the control plane sees it: inventory (None until it registers) and state."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    state: NodeState
    inventory: NodeInventory | None = None
    since: datetime | None = None
    history: list[NodeStatusEntry] = Field(default_factory=list)


def node_id(name: str) -> str:
    """The machine's workflow id."""
    return f"node/{name}"


def node_task_queue(name: str) -> str:
    """The task queue the machine's agent polls."""
    return f"astraeus-node-{name}"
