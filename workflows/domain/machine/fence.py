"""How long a lost machine's workers may still run, and whether a lease's expiry came late (the cluster was away).

Two clocks agree by construction (Nomad's `disconnect`, Kubernetes' node lease, with the gap closed): an agent whose
lease Temporal has not recorded renewed for the fence (`Settings.fence_seconds`) stops its own workers, and the cluster
starts a lost machine's workers elsewhere only once that fence has surely passed (`fenced_at`). A lease that expired
while Temporal or the control plane was away (`expired_late`) gets a probation first: an agent that renews in it was
never lost.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from workflows.domain.machine.liveness import late_after
from workflows.domain.settings import Settings


def fenced_at(now: datetime, settings: Settings) -> datetime:
    """When every worker of a machine whose lease expired at `now` has surely stopped: Temporal recorded its last
    renewal a lease's TTL before at the latest, its agent stops its workers a fence after that renewal, each within
    its stop grace, and the agent's clock may differ from the cluster's by the skew."""
    seconds = (
        settings.fence_seconds
        - settings.node_lease_ttl_seconds
        + settings.stop_grace_seconds
        + settings.clock_skew_seconds
    )
    return now + timedelta(seconds=seconds)


def fenced_after_late(late_at: datetime, settings: Settings) -> datetime:
    """When a worker of a machine whose lease went late at `late_at` has surely stopped there, for a run that counts
    it Down before the machine is lost (its worker's TTL is shorter than the lease's): Temporal recorded the lease's
    last renewal `late_after` before at the latest, and its agent's fence counts from that renewal."""
    seconds = settings.fence_seconds - late_after(settings) + settings.stop_grace_seconds + settings.clock_skew_seconds
    return late_at + timedelta(seconds=seconds)


def expired_late(renewed_at: datetime | None, now: datetime, settings: Settings) -> bool:
    """Whether a lease's expiry reached its workflow late: its last renewal (`renewed_at`, on the agent's clock, sent
    with it) lies more than a TTL, a renewal and the clocks' skew before `now`. An expiry seen on time is a machine
    unheard; a late one, a cluster that was away (Temporal restarted, the control plane reconnected)."""
    if renewed_at is None:
        return False
    ttl = settings.node_lease_ttl_seconds
    return (now - renewed_at).total_seconds() > ttl + ttl / 3 + settings.clock_skew_seconds


# The shortest probation: an agent hears that its lease expired at its next renewal (a third of a lease), then its
# client reconnects to a server just back (its retries back off over seconds) and registers again.
PROBATION_FLOOR_SECONDS = 10.0


def probation(settings: Settings) -> timedelta:
    """How long a lease that expired late waits for its agent to renew (register again) before its machine is lost:
    three renewals (a lease), and never less than PROBATION_FLOOR_SECONDS."""
    return timedelta(seconds=max(settings.node_lease_ttl_seconds, PROBATION_FLOOR_SECONDS))
