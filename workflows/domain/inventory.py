"""Machines (the API says nodes): what each one has, and whether it takes work."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class NodeState(StrEnum):
    READY = "Ready"
    DOWN = "Down"
    REMOVED = "Removed"


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


class NetworkPort(BaseModel):
    """One RDMA-capable port: InfiniBand, or RoCE (an Ethernet link layer)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    link: Literal["InfiniBand", "Ethernet"] = "InfiniBand"
    active: bool = True
    speed_gbps: int = Field(0, ge=0)
    fabric: str | None = Field(None, description="The InfiniBand fabric (subnet) it is on, e.g. ib-0.")


class DriveCopy(BaseModel):
    """A drive of the catalogue that a machine filled a copy of at its data location, kept for its next workers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    drive: str
    path: str = Field(description="The copy, on the machine.")
    size_bytes: int = Field(0, ge=0, description="What the copy holds.")
    filled_at: datetime | None = None


class PortRange(BaseModel):
    """Ports of the machine its agent hands out to workers' external access, first to last (both included)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    first: int = Field(ge=1, le=65535)
    last: int = Field(ge=1, le=65535)

    @model_validator(mode="after")
    def _ordered(self) -> PortRange:
        if self.last < self.first:
            raise ValueError(f"{self.first}-{self.last}: the first port is after the last")
        return self

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return f"{self.first}-{self.last}"


class NodeInventory(BaseModel):
    """What a machine has; the agent reports it when it registers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    address: str = Field("127.0.0.1", description="Where other machines reach this one (a gang's MASTER_ADDR).")
    cpus: float = Field(ge=0)
    memory_bytes: int = Field(ge=0)
    gpus: list[GpuInfo] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    gpu_source: str = "declared"
    # What placement reads besides capacity (workflows/domain/scheduling/placement.py); the rack is the label
    # topology.astraeus.io/rack.
    pools: list[str] = Field(default_factory=list)
    accept_labels: dict[str, str] = Field(default_factory=dict, description="Takes only workers selecting one.")
    site: str | None = None
    ports: list[NetworkPort] = Field(default_factory=list)
    pressure: list[str] = Field(default_factory=list, description='Conditions that stop new work, e.g. "memory".')
    refuses_runs: str | None = Field(None, description="Why the machine takes no new runs (set on its agent).")
    capabilities: list[str] = Field(
        default_factory=list, description="outbound_policy, sandbox, tool_gateway, node_network, mesh"
    )
    capability_notes: dict[str, str] = Field(default_factory=dict, description="Why a capability is missing.")
    data_free_bytes: int | None = Field(None, ge=0, description="Free at its data location; None: none chosen.")
    data_location: str | None = Field(None, description="Where it keeps copies of drives; None: none chosen.")
    drive_copies: list[DriveCopy] = Field(default_factory=list, description="Drives it holds a filled copy of.")
    external_ports: PortRange | None = Field(None, description="Ports it assigns to workers' external access.")


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
    cordon: str | None = None  # why an admin stopped new work here (`astraeus nodes cordon`)
    history: list[NodeStatusEntry] = Field(default_factory=list)
    # The agent holding its lease ("host:pid:token"), while the lease lasts; None after it expired.
    holder: str | None = None
    # Where an admin chose to keep data on it (`astraeus nodes data-location`); its agent uses it, even after a
    # restart with another --data-location.
    data_location: str | None = None
