"""Where a worker may run: the parts of a run spec that placement honours besides cpu, memory and gpus.

Shared by the run spec (what a user writes) and the scheduler's request (what a waiting worker asks for). Plain
frozen models with tuples, so that a request's needs hash and compare cheaply.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workflows.domain.bounds import (
    GPU_MODELS_MAX,
    LABEL_MAX_CHARS,
    MAX_BYTES,
    MAX_PATIENCE_SECONDS,
    MAX_WORKERS,
    SELECTED_MAX,
    Label,
    Pool,
)

# The label a machine's rack is read from (spec: "no rack set on this machine (topology.astraeus.io/rack)").
RACK_LABEL = "topology.astraeus.io/rack"
# Pools are shown as this label in "machine lacks label <k>=<v>" (the spec counts pools as node_selection labels).
POOL_LABEL = "pool.astraeus.io/name"

# The capabilities the scheduler checks on each machine (the spec's per-machine reasons); a model server is set up
# by the machine only ("Model server: <why>").
Capability = Literal["outbound_policy", "sandbox", "tool_gateway"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _gb(value: int) -> str:
    return f"{value / 1e9:g} GB"


class GpuRequest(_Frozen):
    """Which GPUs a worker accepts: any of `models` (empty: any model), from `vendor`, with at least
    `min_memory_bytes` each. Models match the GPU's name as a word, case-insensitively ("H100" matches
    "NVIDIA H100 80GB HBM3")."""

    vendor: str | None = Field(None, max_length=LABEL_MAX_CHARS, description="e.g. nvidia")
    models: tuple[Label, ...] = Field(
        (), max_length=GPU_MODELS_MAX, description="Accepted models, e.g. [H100, H200]; empty accepts any."
    )
    min_memory_bytes: int | None = Field(None, ge=0, le=MAX_BYTES, description="Memory each GPU must have at least.")

    @model_validator(mode="before")
    @classmethod
    def _one_model(cls, data: Any) -> Any:
        """`model: H100` is `models: [H100]`."""
        if isinstance(data, dict) and "model" in data:
            if "models" in data:
                raise ValueError("set model or models, not both")
            data = {**data, "models": [data["model"]]}
            del data["model"]
        return data

    def describe(self) -> str:
        """How the per-machine reason names it: `H100`, `nvidia H100 or H200 with at least 80 GB`."""
        words = [self.vendor] if self.vendor else []
        words.append(" or ".join(self.models) if self.models else "matching")
        text = " ".join(words)
        if self.min_memory_bytes:
            text += f" with at least {_gb(self.min_memory_bytes)}"
        return text


class NodeSelection(_Frozen):
    """node_selection: the machines a worker may use, by name, by label and by pool (all must hold)."""

    names: tuple[Label, ...] = Field((), max_length=SELECTED_MAX, description="Only these machines (empty: any).")
    labels: dict[Label, Label] = Field(
        default_factory=dict, max_length=SELECTED_MAX, description="Labels the machine must carry."
    )
    pools: tuple[Pool, ...] = Field((), max_length=SELECTED_MAX, description="Pools the machine must belong to.")

    def key(self) -> tuple[object, ...]:
        return (self.names, tuple(sorted(self.labels.items())), self.pools)

    def merged(self, other: NodeSelection | None) -> NodeSelection:
        """A run's selection with a group's: both must hold."""
        if other is None:
            return self
        names = tuple(n for n in self.names if n in other.names) if self.names and other.names else None
        return NodeSelection(
            names=names if names is not None else (self.names or other.names),
            labels={**self.labels, **other.labels},
            pools=tuple(dict.fromkeys([*self.pools, *other.pools])),
        )


class Network(_Frozen):
    """What the worker needs from the machine's fabric: any active RDMA port, or InfiniBand at a speed, on a
    fabric. A gang that asks for InfiniBand keeps every member on one fabric."""

    rdma: bool = Field(False, description="Needs an active RDMA port (InfiniBand or RoCE).")
    infiniband_gbps: int | None = Field(
        None, gt=0, le=100_000, description="Needs an active InfiniBand port this fast."
    )
    fabric: Label | None = Field(
        None, description="Needs an active InfiniBand port on this fabric (as its agent reports it, e.g. ib-0)."
    )
    mesh: bool = Field(
        False,
        description="Joins the node network: an address on its machine's subnet, where the run's other workers reach "
        "it, by name (<worker>.<run>.<workspace>) from its own machine, by address from others through the mesh "
        "(docker machines; a run not kept on one machine goes only to machines in the mesh; a gang's groups ask it "
        "all or none, and meet at the leader's address there).",
    )

    @property
    def infiniband(self) -> bool:
        """It asks for an InfiniBand port (a speed or a fabric), not only for any RDMA port."""
        return self.infiniband_gbps is not None or self.fabric is not None


class Topology(_Frozen):
    """How a run's workers sit relative to each other."""

    one_machine: bool = Field(False, description="Every worker on the same machine.")
    same_rack: bool = Field(False, description="Every worker within one rack (label topology.astraeus.io/rack).")
    one_per_rack: bool = Field(False, description="At most one worker of the run per rack.")
    one_per_machine: bool = Field(False, description="At most one worker of the run per machine.")
    max_machines: int | None = Field(None, ge=1, le=MAX_WORKERS, description="The run uses at most this many machines.")
    patience_seconds: float | None = Field(
        None,
        gt=0,
        le=MAX_PATIENCE_SECONDS,
        description="Wait this long for machines on one InfiniBand fabric before starting on Ethernet.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Topology:
        if self.one_machine and (self.one_per_machine or self.one_per_rack):
            raise ValueError("one_machine cannot be combined with one_per_machine or one_per_rack")
        return self


class Drive(_Frozen):
    """A drive as the cluster knows it: where its data is (a machine, in a site), how big it is, and whether it
    can be used. A worker on another machine of the same site gets a copy at that machine's data location."""

    name: str
    size_bytes: int = Field(0, ge=0)
    node: str | None = None
    site: str | None = None
    problem: str | None = None
    source: str = Field("", description="The directory its machines copy it from (a path or a file:// URL).")
