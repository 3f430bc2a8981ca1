"""What the console says of a waiting run: a headline and advice for each pending reason, keyed by its code
(`workflows/domain/reasons.py`), from the spec's pending-reasons table ("Meaning" and "What to do").

The page shows them beside the exact reason, never instead of it: the sentence is the truth, this is the help.
One table in one place, so that a reason added to the spec without advice fails a test (tests/test_console.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from workflows.domain.reasons import R


@dataclass(frozen=True)
class Advice:
    """What a person reads above a waiting run's exact reason: what is going on, and what they can do."""

    headline: str
    advice: str


# The spec's pending reasons, in its order: why a worker (and its run) waits to be placed.
PENDING: dict[str, Advice] = {
    R.NoMachineFits.code: Advice(
        "No machine can take it right now",
        "No machine passes every check. Read What keeps it out below: each machine's reasons, grouped and counted.",
    ),
    R.GangCannotBePlaced.code: Advice(
        "The gang does not fit whole",
        "Not every member of the gang fits at once. Wait, ask for fewer GPUs, or loosen the topology rules.",
    ),
    R.CannotPlaceMinimum.code: Advice(
        "The minimum to start together does not fit",
        "The first min_available workers do not fit together. Lower min_available.",
    ),
    R.NoMachinesRegistered.code: Advice(
        "No machine it may use",
        "The workspace can use no machine on this cluster. Add a machine, or check the workspace's pools.",
    ),
    R.ChooseDataLocation.code: Advice(
        "A drive needs a place to keep its data",
        "A placed drive needs a data location on that machine. Choose one on the machine's page.",
    ),
    R.WaitsForQuota.code: Advice(
        "Waiting on the workspace's quota",
        "The workspace is at its quota; waiting on quota never blocks others. Wait for the workspace's other work "
        "to end, or ask an admin.",
    ),
    R.GangWaitsForQuota.code: Advice(
        "The gang waits on the workspace's quota",
        "The whole gang would go over the workspace's quota. Wait for the workspace's other work to end, or ask an "
        "admin.",
    ),
    R.QuotaNeverEnough.code: Advice(
        "More than the quota ever allows",
        "The run alone exceeds the workspace's quota. Ask for less, or raise the quota.",
    ),
    R.WaitsForGroup.code: Advice(
        "Waiting for another worker group",
        "Its depends_on names a group that is not running (or healthy) yet. It starts once that group is.",
    ),
    R.ArrayMaxParallel.code: Advice(
        "The array is at its limit",
        "array.max_parallel workers run at once; the next starts when one ends. Raise max_parallel for more.",
    ),
    R.WaitingForFabric.code: Advice(
        "Waiting for InfiniBand",
        "topology.patience_seconds keeps it waiting for the fabric; it could start now on Ethernet. Lower the "
        "patience to start sooner.",
    ),
    R.NextToRunStartsBy.code: Advice(
        "Next to run",
        "It heads the queue and room is held for it: it starts by the time shown, as running work ends.",
    ),
    R.NextToRunWaits.code: Advice(
        "Next to run, no start time known",
        "It heads the queue; the running work has no time limit, so no start time is known. Wait.",
    ),
    R.QueuedBehindHigherPriority.code: Advice(
        "Queued behind higher-priority work",
        "A higher-priority run heads the queue. Wait, or raise this run's priority.",
    ),
    R.QueuedBehindStartsBy.code: Advice(
        "Queued behind the head of the queue",
        "The head has the same or lower priority and an earlier claim, and this run cannot fit around it. Give the "
        "run a time limit so it can backfill.",
    ),
    R.QueuedBehind.code: Advice(
        "Queued behind the head of the queue",
        "The head has the same or lower priority and an earlier claim, and this run cannot fit around it. Give the "
        "run a time limit so it can backfill.",
    ),
    R.Preempting.code: Advice(
        "Making room by preemption",
        "It heads the queue and is stopping lower-priority workers to start. Nothing to do: it starts once they stop.",
    ),
    R.WaitingForPreempted.code: Advice(
        "Starting: preempted workers are stopping",
        "The workers it preempted are stopping; it starts once they are gone. Nothing to do.",
    ),
}

# The run's own waiting reasons (the spec's run reasons of state Pending), said the same way.
RUN_PENDING: dict[str, Advice] = {
    R.RunCreated.code: Advice("Just submitted", "The scheduler has not looked at it yet: a moment."),
    R.WaitingForWorkersToBeCreated.code: Advice("Creating its workers", "The scheduler is making its workers."),
    R.CannotPlanWorkers.code: Advice(
        "Cannot be split into workers yet",
        "The run cannot be split into workers on this cluster yet; it is looked at again every 60 s. Ask for a "
        "number of GPUs the machines can share, or fewer.",
    ),
    R.WaitingForWorkersToStart.code: Advice(
        "Waiting for its workers to start", "Its workers exist and wait to be placed."
    ),
    R.PreemptedWaiting.code: Advice(
        "Preempted: waiting to run again",
        "Higher-priority work took its room; it is queued again without spending its restart budget.",
    ),
}


# A run waiting because a worker waits out its back-off (spec: Restarts): its reason is the worker's failure.
RESTARTING = Advice(
    "Restarting after a failure",
    "A worker failed and is started again after its back-off (10 s, doubling each time, at most 5 min), at most 10 "
    "times. Read its last failure and log tail below.",
)


# A worker's last failure, by its exact sentence (a last failure keeps the sentence, not the code): the spec's
# "Meaning" of the failure reasons that say what to change.
FAILURES: dict[str, Advice] = {
    R.OOMKilled().text: Advice(
        "Out of memory",
        "The worker used more host memory than its limit. Raise memory_bytes (or per_gpu.memory_bytes, which its "
        "GPUs multiply).",
    ),
}


def table() -> dict[str, Any]:
    """The advice as the console reads it (`GET /console/advice.json`): by reason code, `restarting`, and by a last
    failure's sentence."""
    return {
        "reasons": {code: asdict(advice) for code, advice in {**RUN_PENDING, **PENDING}.items()},
        "restarting": asdict(RESTARTING),
        "failures": {text: asdict(advice) for text, advice in FAILURES.items()},
    }
