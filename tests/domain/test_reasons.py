"""Every reason template, filled, is the spec's sentence letter for letter.

The expected sentences below are copied from `spec/run-and-worker-states.md` (its examples where it gives
them), not from `reasons.py`: a template that drifts from the spec fails here.
"""

from __future__ import annotations

from typing import Any

import pytest

from workflows.domain.reasons import ANOTHER_NAMESPACE, R, Reason, Template, all_templates

Row = tuple[str, dict[str, Any], str]

RUN_REASONS: list[Row] = [
    ("RunCreated", {}, "Run created"),
    ("WaitingForWorkersToBeCreated", {}, "Waiting for workers to be created"),
    (
        "CannotPlanWorkers",
        {"why": "cannot evenly distribute 12 gpus across 5 machines"},
        "Cannot plan workers: cannot evenly distribute 12 gpus across 5 machines",
    ),
    ("WaitingForWorkersToStart", {}, "Waiting for workers to start"),
    (
        "PreemptedWaiting",
        {"cause": "Preempted by higher-priority work (urgent-eval)"},
        "Preempted by higher-priority work (urgent-eval); waiting to run again",
    ),
    ("StartingTogether", {"ready": 3, "total": 4}, "Starting together: 3 of 4 ready"),
    ("WorkersRunning", {"running": 2, "total": 2}, "2 of 2 workers running"),
    ("WorkersServing", {"running": 1, "total": 2}, "1 of 2 workers serving"),
    ("AllWorkersCompleted", {}, "All workers completed"),
    ("GroupCompleted", {"group": "eval"}, "Worker group eval completed"),
    (
        "WorkerFailed",
        {"task": "w-0", "node": "n0", "reason": "Exited with code 3"},
        "Worker w-0 failed on n0: Exited with code 3",
    ),
    (
        "WorkerLost",
        {"task": "w-0", "node": "n0", "reason": "Machine lost: its lease expired"},
        "Worker w-0 was lost on n0: Machine lost: its lease expired",
    ),
    (
        "GangMemberFailed",
        {"failure": "Worker train-1 failed on n1: Exited with code 1"},
        "Worker train-1 failed on n1: Exited with code 1; the gang does not run without it",
    ),
    (
        "WorkersFailed",
        {"failed": 2, "total": 3, "first": "Worker w-0 failed on n0: Exited with code 3"},
        "2 of 3 workers failed; the first: Worker w-0 failed on n0: Exited with code 3",
    ),
    ("WorkerTimeLimit", {"task": "w-0", "duration": "1h"}, "Worker w-0: Exceeded its time limit of 1h"),
    (
        "GroupCannotFinish",
        {"failure": "Worker serve-0 failed on n0: Exited with code 1", "group": "eval"},
        "Worker serve-0 failed on n0: Exited with code 1; worker group eval cannot finish without it",
    ),
    ("SomeCancelled", {}, "All workers ended; some were cancelled"),
    ("QuotaReached", {"why": "gpus 6 in use + 4 asked > 8"}, "Quota reached: gpus 6 in use + 4 asked > 8"),
]

PLAN_WHYS: list[Row] = [
    ("PlanUneven", {"gpus": 12, "machines": 5}, "cannot evenly distribute 12 gpus across 5 machines"),
    (
        "PlanNotPowerOfTwo",
        {"gpus": 16, "machines": 2, "per": 8},
        "16 gpus across 2 machines is 8 per worker, not a power of 2",
    ),
    (
        "PlanNoWay",
        {"gpus": 16, "free": 4},
        "no way to run 16 GPUs on these machines: 4 free on the largest one now",
    ),
    ("PlanNoHost", {"group": "train"}, "no machine can host a worker of group train right now"),
]

LIVENESS: list[Row] = [
    ("HeartbeatLeaseExpired", {}, "Heartbeat lease expired"),
    ("HeartbeatReceived", {}, "Heartbeat received"),
    ("NoHeartbeatForTtl", {}, "No heartbeat for the worker's full TTL after going stale"),
    ("MachineLost", {}, "Machine lost: its lease expired"),
    ("MachineRemoved", {}, "Machine removed from the cluster"),
    ("MachineLostWhileStopping", {}, "Machine lost while stopping"),
    ("MachineRemovedWhileStopping", {}, "Machine removed from the cluster while stopping"),
]

RESTARTS: list[Row] = [
    ("RetryBudgetExhausted", {"restarts": 10, "budget": 10}, "Retry budget exhausted after 10/10 restarts"),
    ("GangRestart", {"task": "train-1"}, "Gang restart: train-1 failed"),
    ("RestartedByPolicy", {"restart": 2, "budget": 10}, "Restarted by policy (restart 2/10)"),
    ("PreemptedQueuedAgain", {"run": "urgent-eval"}, "Preempted by urgent-eval; queued again"),
]

MACHINE_REASONS: list[Row] = [
    ("WaitingForNodeNetwork", {}, "Waiting for the node network (subnet assignment and mesh)"),
    ("WaitingForExternalPort", {}, "Waiting for its external port to be assigned"),
    (
        "WaitingForDataVolume",
        {"volume": "datasets", "why": "not attached yet"},
        "Waiting for data volume datasets: not attached yet",
    ),
    ("WaitingForDriveFill", {"drive": "ckpt", "node": "n0"}, "Waiting for drive ckpt to be filled on n0"),
    (
        "WaitingForExternalSecret",
        {"secret": "hf", "key": "token"},
        "waiting for external secret hf (key token) to be synced to this node",
    ),
    ("WaitingForRegistrySecret", {"secret": "ghcr"}, "waiting for registry secret ghcr to be synced to this node"),
    (
        "WaitingForIdentity",
        {"why": "no certificate yet"},
        "Waiting for the worker's identity: no certificate yet",
    ),
    ("Pulling", {"image": "ghcr.io/acme/train:1"}, "Pulling ghcr.io/acme/train:1"),
    ("WaitingAtBarrier", {}, "Waiting at the gang barrier"),
    ("ContainerStarted", {}, "Container started"),
    ("ContainerRunning", {}, "Container running"),
    ("ExitedWithCode", {"exit_code": 3}, "Exited with code 3"),
    ("OOMKilled", {}, "OOMKilled: the container exceeded its memory limit"),
    ("ErrImagePull", {"error": "manifest unknown"}, "ErrImagePull: manifest unknown"),
    ("ImageNotPresent", {"image": "train:1"}, "Image train:1 is not present and the pull policy is None"),
    ("ContainerCreateFailed", {"error": "no such device"}, "Container create failed: no such device"),
    ("ContainerStartFailed", {"error": "exec format error"}, "Container start failed: exec format error"),
    ("ContainerNotFound", {}, "Container not found on the node"),
    ("InvalidTask", {"error": "mount path /proc is refused"}, "Invalid task: mount path /proc is refused"),
    (
        "WritingConfigFailed",
        {"path": "/etc/app.toml", "error": "permission denied"},
        "Writing config /etc/app.toml: permission denied",
    ),
    ("OutboundPolicyFailed", {"why": "nftables missing"}, "Outbound policy: nftables missing"),
    ("AgentSandboxFailed", {"why": "gVisor missing"}, "Agent sandbox: gVisor missing"),
    ("ModelServerFailed", {"why": "port in use"}, "Model server: port in use"),
    ("InteractiveTokenFailed", {"why": "expired"}, "Interactive token: expired"),
    ("StoppedOnRequest", {}, "Stopped on request"),
]

STOP_REASONS: list[Row] = [
    ("PreemptedByHigherPriority", {"run": "urgent-eval"}, "Preempted by higher-priority work (urgent-eval)"),
    ("ExceededTimeLimit", {"duration": "2h"}, "Exceeded its time limit of 2h"),
    ("GangMemberExhaustedBudget", {}, "A gang member exhausted its restart budget"),
    ("WorkerFailedRunFails", {}, "A worker failed, and the run fails on a failure"),
    ("GangMemberExceededTimeLimit", {}, "A gang member exceeded its time limit"),
    ("WorkerExceededTimeLimit", {}, "A worker exceeded its time limit"),
    ("GangBarrierTimedOut", {}, "Gang barrier timed out waiting for all members"),
    ("RunFailed", {}, "Run failed"),
    ("RunCompleted", {}, "Run completed"),
    ("RunCancelled", {}, "Run cancelled"),
    ("StoppedByScheduler", {}, "Stopped by scheduler"),
]

PENDING_REASONS: list[Row] = [
    ("NoMachineFits", {"ready": 1, "total": 2}, "No machine fits: 1 of 2 machines ready"),
    ("GangCannotBePlaced", {"ready": 3, "total": 4}, "Gang cannot be placed whole: 3 of 4 machines ready"),
    (
        "CannotPlaceMinimum",
        {"why": "2 of 4 fit"},
        "Cannot place the minimum to start together: 2 of 4 fit",
    ),
    (
        "NoMachinesRegistered",
        {"reason": "No machine fits: 0 of 0 machines ready"},
        "No machine fits: 0 of 0 machines ready: no machines are registered",
    ),
    ("ChooseDataLocation", {"node": "n0"}, "Choose where to keep data on n0"),
    (
        "WaitsForQuota",
        {"resource": "gpus", "used": 6, "asked": 4, "limit": 8},
        "Waits for namespace quota: gpus 6 in use + 4 asked > 8",
    ),
    (
        "GangWaitsForQuota",
        {"resource": "gpus", "used": 6, "asked": 4, "limit": 8},
        "Gang waits for namespace quota: gpus 6 in use + 4 asked > 8",
    ),
    (
        "QuotaNeverEnough",
        {"why": "gpus 16 asked > 8"},
        "Waits for more than the namespace's quota allows at all (gpus 16 asked > 8): raise the quota or ask for less",
    ),
    ("WaitsForGroup", {"group": "db", "condition": "running"}, "Waits for worker group db to be running"),
    ("WaitsForGroup", {"group": "db", "condition": "healthy"}, "Waits for worker group db to be healthy"),
    ("ArrayMaxParallel", {"k": 4}, "Array runs at most 4 workers at once"),
    (
        "WaitingForFabric",
        {"minutes": 6, "fabric": "ib-0"},
        "Waiting up to 6 min more for InfiniBand fabric ib-0 (could start now on Ethernet)",
    ),
    (
        "NextToRunStartsBy",
        {"priority": 5, "time": "2025-01-01 14:30"},
        "Next to run (priority 5): starts by 2025-01-01 14:30 UTC as running work ends",
    ),
    ("NextToRunWaits", {"priority": 5}, "Next to run (priority 5): waits for running work to end"),
    ("QueuedBehindHigherPriority", {"run": "urgent-eval"}, "Queued behind higher-priority work (urgent-eval)"),
    (
        "QueuedBehindStartsBy",
        {"run": "pretrain", "time": "2025-01-01 14:30"},
        "Queued behind pretrain, which starts by 2025-01-01 14:30 UTC",
    ),
    ("QueuedBehind", {"run": "pretrain"}, "Queued behind pretrain"),
    ("QueuedBehind", {"run": ANOTHER_NAMESPACE}, "Queued behind (a job in another namespace)"),
    (
        "Preempting",
        {"k": 2, "runs": "batch-7"},
        "Preempting 2 lower-priority worker(s) of batch-7 to start",
    ),
    ("WaitingForPreempted", {"k": 2}, "Starting: waiting for 2 preempted worker(s) to stop"),
]

PER_MACHINE_REASONS: list[Row] = [
    ("NodeNotReady", {"state": "Down"}, "machine is not ready (Down)"),
    ("NodeNoCapacity", {}, "machine is not ready (no capacity reported)"),
    ("UnderPressure", {"condition": "MemoryPressure"}, "under pressure: MemoryPressure"),
    ("NotAcceptingRuns", {"why": "maintenance"}, "machine does not accept runs: maintenance"),
    ("Cordoned", {"why": "bad fan"}, "machine is cordoned: bad fan"),
    ("NoAcceptedLabel", {}, "worker carries none of the labels this machine accepts"),
    ("NotSelectedName", {}, "machine is not among the selected names"),
    ("LacksLabel", {"key": "pool", "value": "a100"}, "machine lacks label pool=a100"),
    ("NoRdmaPort", {}, "no active RDMA port"),
    (
        "NoInfinibandPort",
        {"speed": 200, "detail": "mlx5_0 at 100 Gb/s"},
        "no active InfiniBand port at 200 Gb/s or faster (mlx5_0 at 100 Gb/s)",
    ),
    ("AnotherWorkerOnMachine", {}, "another worker of this run is already on the machine"),
    ("InsufficientCpu", {"need": 32, "free": 16}, "insufficient cpu: need 32 cores, 16 free"),
    ("InsufficientMemory", {"need": 100, "free": 50}, "insufficient memory: need 100 bytes, 50 free"),
    ("InsufficientGpus", {"need": 8, "free": 4}, "insufficient gpus: need 8, 4 free and usable"),
    ("HealthyGpus", {"need": 8, "free": 6, "at_risk": 2}, "needs 8 healthy GPUs, 6 free (2 more free but at risk)"),
    ("NoMatchingGpu", {"request": "H100"}, "no H100 GPU"),
    (
        "NoMatchingGpu",
        {"request": "nvidia H100 or H200 with at least 80 GB"},
        "no nvidia H100 or H200 with at least 80 GB GPU",
    ),
    ("GpuFault", {"index": 3, "fault": "Xid 79"}, "gpu fault on the machine: GPU 3: Xid 79"),
    ("KeptOnOneMachine", {"node": "n0"}, "the run is kept on one machine, n0"),
    ("KeptWithinRack", {"rack": "r1"}, "the run is kept within rack r1"),
    ("NoRackLabel", {}, "no rack set on this machine (topology.astraeus.io/rack)"),
    ("MaxMachines", {"n": 2}, "the run may use at most 2 machines"),
    ("RackAlreadyUsed", {"rack": "r1"}, "rack r1 already has a worker of this run"),
    ("DriveMissing", {"drive": "ckpt"}, "drive ckpt does not exist"),
    ("DriveProblem", {"drive": "ckpt", "why": "being copied"}, "drive ckpt: being copied"),
    (
        "DriveOtherSite",
        {"drive": "ckpt", "node": "n3", "site": "eu-west"},
        "drive ckpt is on n3, in another site (eu-west)",
    ),
    (
        "DriveNoSpace",
        {"drive": "ckpt", "size": "100 GiB", "free": "20 GiB"},
        "drive ckpt needs 100 GiB at this machine's data location, 20 GiB free",
    ),
    (
        "NoOutboundPolicy",
        {"why": "no nftables"},
        "machine cannot enforce an outbound policy (no nftables)",
    ),
    ("NoSandbox", {"why": "no gVisor"}, "machine cannot run sandboxed workers (no gVisor)"),
    ("NoToolGateway", {"why": "gateway disabled"}, "machine serves no tool gateway to its workers (gateway disabled)"),
]

SPEC_TABLES: dict[str, list[Row]] = {
    "run reasons": RUN_REASONS,
    "plan whys": PLAN_WHYS,
    "liveness": LIVENESS,
    "restarts": RESTARTS,
    "worker reasons from its machine": MACHINE_REASONS,
    "stop reasons": STOP_REASONS,
    "pending reasons": PENDING_REASONS,
    "per-machine reasons": PER_MACHINE_REASONS,
}

# Not in the spec's tables: Astraeus additions, documented in reasons.py (and workflows/README.md).
ADDITIONS: list[Row] = [
    (
        "NoExternalPorts",
        {"why": "its agent has no --external-ports range"},
        "machine exposes no external ports to its workers (its agent has no --external-ports range)",
    ),
    (
        "NoNodeNetwork",
        {"why": "its workers run as processes on the machine's own network"},
        "machine cannot host the node network (its workers run as processes on the machine's own network)",
    ),
    ("Placed", {"node": "n0"}, "Placed on n0"),
    ("GangRestartLost", {"task": "w-1", "node": "n1"}, "Gang restart: w-1 was lost on n1"),
    (
        "WaitsForFence",
        {"time": "2026-01-01 00:02:05", "node": "n0"},
        "Restarts at 2026-01-01 00:02:05 UTC, once its copy on n0 has surely stopped",
    ),
    ("PickedUp", {"node": "n0"}, "Picked up by n0"),
    ("NodeRegistered", {}, "Registered by its agent"),
    (
        "HistorySummarised",
        {"count": 40, "first": "2026-01-01 00:00:03 UTC", "last": "2026-01-01 00:09:00 UTC"},
        "40 earlier changes summarised, from 2026-01-01 00:00:03 UTC to 2026-01-01 00:09:00 UTC",
    ),
    ("RunTerminated", {"why": "stuck"}, "Its workflow was terminated in Temporal: stuck"),
    ("RemovedByAdmin", {"why": "motherboard replaced"}, "An admin removes it: motherboard replaced"),
    (
        "OrphanStopped",
        {"task": "w-0", "run": "default/sleepy", "status": "terminated"},
        "Stopped worker w-0 of run default/sleepy: its run is no longer open (terminated)",
    ),
    (
        "StaleAttemptStopped",
        {"task": "w-0", "attempt": 3, "run": "default/sleepy"},
        "Stopped worker w-0 (attempt 3) of run default/sleepy: its run no longer has it here",
    ),
    (
        "StartRefused",
        {"attempt": 3, "task": "w-0", "why": "its run has attempt 4 on m2"},
        "Start refused: attempt 3 of worker w-0 is no longer its run's (its run has attempt 4 on m2)",
    ),
    (
        "CannotBeScheduled",
        {"error": "OverflowError: date value out of range"},
        "Cannot be scheduled: OverflowError: date value out of range",
    ),
    ("CannotBeDecided", {"error": "KeyError: 'w-9'"}, "Cannot be decided: KeyError: 'w-9'"),
    ("WorkerFailedNowhere", {"task": "w-0", "reason": "Exited with code 3"}, "Worker w-0 failed: Exited with code 3"),
    ("RunDeleted", {}, "Run deleted"),
    (
        "NoFabricPort",
        {"fabric": "ib-1", "detail": "mlx5_0 active at 400 Gb/s on fabric ib-0"},
        "no active InfiniBand port on fabric ib-1 (mlx5_0 active at 400 Gb/s on fabric ib-0)",
    ),
]

ALL_ROWS = [row for rows in SPEC_TABLES.values() for row in rows] + ADDITIONS


def _template(code: str) -> Template:
    template = getattr(R, code)
    assert isinstance(template, Template)
    return template


@pytest.mark.parametrize(("code", "values", "expected"), [pytest.param(*row, id=row[2]) for row in ALL_ROWS])
def test_a_filled_template_is_the_spec_sentence(code: str, values: dict[str, Any], expected: str) -> None:
    assert _template(code).fill(**values) == Reason(code, expected)


@pytest.mark.parametrize(("code", "values", "expected"), [pytest.param(*row, id=row[2]) for row in ALL_ROWS])
def test_calling_a_template_is_filling_it(code: str, values: dict[str, Any], expected: str) -> None:
    assert _template(code)(**values) == _template(code).fill(**values)


def test_every_template_is_covered_by_the_spec_tables_or_the_additions() -> None:
    covered = {code for code, _, _ in ALL_ROWS}
    assert covered == {template.code for template in all_templates()}


def test_every_code_is_unique() -> None:
    codes = [template.code for template in all_templates()]
    assert len(codes) == len(set(codes))


def test_every_code_equals_its_attribute_name() -> None:
    mismatched = {
        name: value.code for name, value in vars(R).items() if isinstance(value, Template) and value.code != name
    }
    assert mismatched == {}


def test_all_templates_lists_every_template_of_r() -> None:
    assert len(all_templates()) == sum(isinstance(value, Template) for value in vars(R).values())


@pytest.mark.parametrize(
    ("template", "fields"),
    [
        pytest.param(R.RunCreated, (), id="a sentence without placeholders has no fields"),
        pytest.param(R.WorkerFailed, ("task", "node", "reason"), id="fields are listed in sentence order"),
        pytest.param(R.WaitsForQuota, ("resource", "used", "asked", "limit"), id="quota names four fields"),
    ],
)
def test_fields_are_the_placeholders(template: Template, fields: tuple[str, ...]) -> None:
    assert template.fields == fields


@pytest.mark.parametrize(
    ("template", "values", "message"),
    [
        pytest.param(
            R.InsufficientGpus,
            {"need": 8},
            "reason InsufficientGpus: missing ['free'], unexpected []",
            id="a missing placeholder raises",
        ),
        pytest.param(
            R.RunCreated,
            {"why": "x"},
            "reason RunCreated: missing [], unexpected ['why']",
            id="an extra value raises",
        ),
        pytest.param(
            R.WorkerFailed,
            {"task": "w-0", "machine": "n0", "reason": "x"},
            "reason WorkerFailed: missing ['node'], unexpected ['machine']",
            id="a misnamed placeholder raises naming both",
        ),
    ],
)
def test_fill_refuses_missing_or_extra_values(template: Template, values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as raised:
        template.fill(**values)
    assert str(raised.value) == message


def test_calling_a_template_refuses_missing_values_too() -> None:
    with pytest.raises(ValueError):
        R.ExitedWithCode()


def test_runs_of_another_namespace_are_never_named() -> None:
    assert ANOTHER_NAMESPACE == "(a job in another namespace)"
