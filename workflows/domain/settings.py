"""Every duration and default of the spec, in one model, so tests can shrink them and operators tune them."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workflows.domain.bounds import DAY_SECONDS, YEAR_SECONDS
from workflows.domain.subnets import range_problem

# Bounded like a run spec's fields (workflows/domain/bounds.py): they feed dates and timers, which must not overflow.


class Settings(BaseModel):
    """The spec's timers and defaults; `--settings FILE` overrides them (unknown keys are errors)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    backoff_base_seconds: float = Field(10, gt=0, le=DAY_SECONDS, description="Back-off before the first restart.")
    backoff_cap_seconds: float = Field(300, gt=0, le=DAY_SECONDS, description="Longest back-off between restarts.")
    restart_budget: int = Field(10, ge=0, le=10_000, description="Restarts allowed before a failure is final.")
    restart_reset_seconds: float = Field(
        600, gt=0, le=YEAR_SECONDS, description="Running this long resets the restart count."
    )
    stale_grace_seconds: float = Field(
        15, gt=0, le=DAY_SECONDS, description="Grace after a missed heartbeat before Stale."
    )
    heartbeat_ttl_seconds: float = Field(
        60, gt=0, le=DAY_SECONDS, description="Default heartbeat_ttl_seconds of a worker."
    )
    barrier_timeout_seconds: float = Field(900, gt=0, le=YEAR_SECONDS, description="Gang barrier timeout.")
    replan_interval_seconds: float = Field(
        60, gt=0, le=DAY_SECONDS, description="Re-look at runs that cannot be planned."
    )
    node_lease_ttl_seconds: float = Field(
        30, gt=0, le=DAY_SECONDS, description="A machine is Down after this long unheard."
    )
    scheduler_lease_ttl_seconds: float = Field(
        15, gt=0, le=DAY_SECONDS, description="A scheduler unheard this long loses its lease; a standby takes over."
    )
    stop_grace_seconds: float = Field(10, ge=0, le=DAY_SECONDS, description="Between the stop signal and the kill.")
    fence_after_seconds: float | None = Field(
        None,
        gt=0,
        le=DAY_SECONDS,
        description="An agent whose lease Temporal has not recorded renewed for this long stops its workers (its "
        "fence), and a lost machine's workers start again elsewhere only once its fence surely passed. The longest "
        "Temporal or the control plane may be away with no worker stopped. Default: 4 leases (120 s).",
    )
    clock_skew_seconds: float = Field(
        5, ge=0, le=DAY_SECONDS, description="How far machines' clocks may differ: added to a lost machine's fence."
    )
    orphan_check_seconds: float = Field(
        5, gt=0, le=DAY_SECONDS, description="How often an agent looks for workers of runs no longer open."
    )
    log_tail_lines: int = Field(50, gt=0, le=100_000, description="Lines of log kept in last_failure.")
    log_tail_bytes: int = Field(16 * 1024, gt=0, le=1024 * 1024, description="Bytes of log kept in last_failure.")
    continue_as_new_events: int = Field(
        4000, ge=50, le=40_000, description="A run's workflow continues as new past this."
    )
    history_keep: int = Field(200, ge=10, le=10_000, description="Entries kept per history; older ones are summarised.")
    identity_ttl_seconds: float = Field(
        3600, ge=10, le=DAY_SECONDS, description="How long a worker's certificate is valid; renewed at half its life."
    )
    node_subnet_range: str = Field(
        "10.200.0.0/16", description="The node network's range: each machine gets one subnet of it (IPv4)."
    )
    node_subnet_prefix: int = Field(24, ge=8, le=30, description="The size of each machine's subnet (a /24: 254).")
    mesh_refresh_seconds: float = Field(
        10, gt=0, le=DAY_SECONDS, description="How often a machine in the mesh asks for its peers and sets them."
    )

    @model_validator(mode="after")
    def _subnets(self) -> Settings:
        problem = range_problem(self.node_subnet_range, self.node_subnet_prefix)
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _fence(self) -> Settings:
        if self.fence_after_seconds is not None and self.fence_after_seconds < self.node_lease_ttl_seconds:
            raise ValueError(
                f"fence_after_seconds ({self.fence_after_seconds:g}) is shorter than node_lease_ttl_seconds "
                f"({self.node_lease_ttl_seconds:g}): an agent would stop its workers before its machine is lost"
            )
        return self

    @property
    def fence_seconds(self) -> float:
        """How long an agent unheard by Temporal keeps its workers running: `fence_after_seconds`, else 4 leases."""
        return self.fence_after_seconds if self.fence_after_seconds is not None else 4 * self.node_lease_ttl_seconds
