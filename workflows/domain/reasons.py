"""Every reason of the spec (`spec/run-and-worker-states.md`), each with a stable machine code.

People read `text`; code branches on `code`. No reason string is written anywhere else: callers fill a template
with `R.<Name>.fill(...)`. The order below follows the spec's tables. `NodeReasons`, one machine's reasons, is here
because both the scheduler's pass (which says them) and the run (which keeps them) need it.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

# How reasons name a run of another namespace (spec: "Runs from another workspace are never named").
ANOTHER_NAMESPACE = "(a job in another namespace)"


# The code of a reason that crossed the wire as a bare sentence, before per-machine reasons carried their codes
# (placement signals and run records of earlier versions): its sentence is kept as it was, its code is not known.
UNCODED = "Uncoded"


@dataclass(frozen=True)
class Reason:
    """A filled reason: the stable code and the exact sentence. Messages and records carry it whole (JSON
    `{"code": ..., "text": ...}`), so code reads the code and people the sentence."""

    code: str
    text: str


@dataclass(frozen=True)
class Template:
    """One reason template; `{name}` placeholders are filled by `fill`."""

    code: str
    template: str

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(name for _, name, _, _ in string.Formatter().parse(self.template) if name)

    def fill(self, **values: Any) -> Reason:
        missing = set(self.fields) - set(values)
        extra = set(values) - set(self.fields)
        if missing or extra:
            raise ValueError(f"reason {self.code}: missing {sorted(missing)}, unexpected {sorted(extra)}")
        if ANOTHER_NAMESPACE in values.values():
            # Where the template already puts the run in parentheses, they are said once: "Queued behind
            # higher-priority work (a job in another namespace)", never "((a job in another namespace))".
            for name, value in values.items():
                if value == ANOTHER_NAMESPACE and f"({{{name}}})" in self.template:
                    values[name] = ANOTHER_NAMESPACE[1:-1]
        return Reason(self.code, self.template.format(**values))

    def __call__(self, **values: Any) -> Reason:
        return self.fill(**values)


def _t(code: str, template: str) -> Template:
    return Template(code, template)


class R:
    """The closed vocabulary. Attribute names are the codes."""

    # --- Run reasons -----------------------------------------------------------------------------------------
    RunCreated = _t("RunCreated", "Run created")
    WaitingForWorkersToBeCreated = _t("WaitingForWorkersToBeCreated", "Waiting for workers to be created")
    CannotPlanWorkers = _t("CannotPlanWorkers", "Cannot plan workers: {why}")
    WaitingForWorkersToStart = _t("WaitingForWorkersToStart", "Waiting for workers to start")
    PreemptedWaiting = _t("PreemptedWaiting", "{cause}; waiting to run again")
    StartingTogether = _t("StartingTogether", "Starting together: {ready} of {total} ready")
    WorkersRunning = _t("WorkersRunning", "{running} of {total} workers running")
    WorkersServing = _t("WorkersServing", "{running} of {total} workers serving")
    AllWorkersCompleted = _t("AllWorkersCompleted", "All workers completed")
    GroupCompleted = _t("GroupCompleted", "Worker group {group} completed")
    WorkerFailed = _t("WorkerFailed", "Worker {task} failed on {node}: {reason}")
    WorkerLost = _t("WorkerLost", "Worker {task} was lost on {node}: {reason}")
    GangMemberFailed = _t("GangMemberFailed", "{failure}; the gang does not run without it")
    WorkersFailed = _t("WorkersFailed", "{failed} of {total} workers failed; the first: {first}")
    WorkerTimeLimit = _t("WorkerTimeLimit", "Worker {task}: Exceeded its time limit of {duration}")
    GroupCannotFinish = _t("GroupCannotFinish", "{failure}; worker group {group} cannot finish without it")
    SomeCancelled = _t("SomeCancelled", "All workers ended; some were cancelled")
    QuotaReached = _t("QuotaReached", "Quota reached: {why}")

    # --- "Cannot plan workers: <why>" ------------------------------------------------------------------------
    PlanUneven = _t("PlanUneven", "cannot evenly distribute {gpus} gpus across {machines} machines")
    PlanNotPowerOfTwo = _t(
        "PlanNotPowerOfTwo", "{gpus} gpus across {machines} machines is {per} per worker, not a power of 2"
    )
    PlanNoWay = _t("PlanNoWay", "no way to run {gpus} GPUs on these machines: {free} free on the largest one now")
    PlanNoHost = _t("PlanNoHost", "no machine can host a worker of group {group} right now")

    # --- Liveness --------------------------------------------------------------------------------------------
    HeartbeatLeaseExpired = _t("HeartbeatLeaseExpired", "Heartbeat lease expired")
    HeartbeatReceived = _t("HeartbeatReceived", "Heartbeat received")
    NoHeartbeatForTtl = _t("NoHeartbeatForTtl", "No heartbeat for the worker's full TTL after going stale")
    MachineLost = _t("MachineLost", "Machine lost: its lease expired")
    MachineRemoved = _t("MachineRemoved", "Machine removed from the cluster")
    MachineLostWhileStopping = _t("MachineLostWhileStopping", "Machine lost while stopping")
    MachineRemovedWhileStopping = _t("MachineRemovedWhileStopping", "Machine removed from the cluster while stopping")
    # Not in the spec: a worker lost with its machine waits for that machine's agent to have surely stopped it (its
    # fence) before it starts again elsewhere, when that comes after its back-off.
    WaitsForFence = _t("WaitsForFence", "Restarts at {time} UTC, once its copy on {node} has surely stopped")

    # --- Restarts --------------------------------------------------------------------------------------------
    RetryBudgetExhausted = _t("RetryBudgetExhausted", "Retry budget exhausted after {restarts}/{budget} restarts")
    GangRestart = _t("GangRestart", "Gang restart: {task} failed")
    # Not in the spec: the spec's "Gang restart: <w> failed" for a member lost with its machine (Down) says so, as
    # "Worker <w> was lost on <machine>" does for a run that fails on one.
    GangRestartLost = _t("GangRestartLost", "Gang restart: {task} was lost on {node}")
    RestartedByPolicy = _t("RestartedByPolicy", "Restarted by policy (restart {restart}/{budget})")
    PreemptedQueuedAgain = _t("PreemptedQueuedAgain", "Preempted by {run}; queued again")

    # --- Worker reasons from its machine ---------------------------------------------------------------------
    WaitingForNodeNetwork = _t("WaitingForNodeNetwork", "Waiting for the node network (subnet assignment and mesh)")
    WaitingForExternalPort = _t("WaitingForExternalPort", "Waiting for its external port to be assigned")
    WaitingForDataVolume = _t("WaitingForDataVolume", "Waiting for data volume {volume}: {why}")
    WaitingForDriveFill = _t("WaitingForDriveFill", "Waiting for drive {drive} to be filled on {node}")
    WaitingForExternalSecret = _t(
        "WaitingForExternalSecret", "waiting for external secret {secret} (key {key}) to be synced to this node"
    )
    WaitingForRegistrySecret = _t(
        "WaitingForRegistrySecret", "waiting for registry secret {secret} to be synced to this node"
    )
    WaitingForIdentity = _t("WaitingForIdentity", "Waiting for the worker's identity: {why}")
    Pulling = _t("Pulling", "Pulling {image}")
    WaitingAtBarrier = _t("WaitingAtBarrier", "Waiting at the gang barrier")
    ContainerStarted = _t("ContainerStarted", "Container started")
    ContainerRunning = _t("ContainerRunning", "Container running")
    ExitedWithCode = _t("ExitedWithCode", "Exited with code {exit_code}")
    OOMKilled = _t("OOMKilled", "OOMKilled: the container exceeded its memory limit")
    ErrImagePull = _t("ErrImagePull", "ErrImagePull: {error}")
    ImageNotPresent = _t("ImageNotPresent", "Image {image} is not present and the pull policy is None")
    ContainerCreateFailed = _t("ContainerCreateFailed", "Container create failed: {error}")
    ContainerStartFailed = _t("ContainerStartFailed", "Container start failed: {error}")
    ContainerNotFound = _t("ContainerNotFound", "Container not found on the node")
    InvalidTask = _t("InvalidTask", "Invalid task: {error}")
    WritingConfigFailed = _t("WritingConfigFailed", "Writing config {path}: {error}")
    OutboundPolicyFailed = _t("OutboundPolicyFailed", "Outbound policy: {why}")
    AgentSandboxFailed = _t("AgentSandboxFailed", "Agent sandbox: {why}")
    ModelServerFailed = _t("ModelServerFailed", "Model server: {why}")
    InteractiveTokenFailed = _t("InteractiveTokenFailed", "Interactive token: {why}")
    StoppedOnRequest = _t("StoppedOnRequest", "Stopped on request")

    # --- Stop reasons and causes -----------------------------------------------------------------------------
    PreemptedByHigherPriority = _t("PreemptedByHigherPriority", "Preempted by higher-priority work ({run})")
    ExceededTimeLimit = _t("ExceededTimeLimit", "Exceeded its time limit of {duration}")
    GangMemberExhaustedBudget = _t("GangMemberExhaustedBudget", "A gang member exhausted its restart budget")
    WorkerFailedRunFails = _t("WorkerFailedRunFails", "A worker failed, and the run fails on a failure")
    GangMemberExceededTimeLimit = _t("GangMemberExceededTimeLimit", "A gang member exceeded its time limit")
    WorkerExceededTimeLimit = _t("WorkerExceededTimeLimit", "A worker exceeded its time limit")
    GangBarrierTimedOut = _t("GangBarrierTimedOut", "Gang barrier timed out waiting for all members")
    RunFailed = _t("RunFailed", "Run failed")
    RunCompleted = _t("RunCompleted", "Run completed")
    RunCancelled = _t("RunCancelled", "Run cancelled")
    StoppedByScheduler = _t("StoppedByScheduler", "Stopped by scheduler")

    # --- Pending reasons -------------------------------------------------------------------------------------
    NoMachineFits = _t("NoMachineFits", "No machine fits: {ready} of {total} machines ready")
    GangCannotBePlaced = _t("GangCannotBePlaced", "Gang cannot be placed whole: {ready} of {total} machines ready")
    CannotPlaceMinimum = _t("CannotPlaceMinimum", "Cannot place the minimum to start together: {why}")
    NoMachinesRegistered = _t("NoMachinesRegistered", "{reason}: no machines are registered")
    ChooseDataLocation = _t("ChooseDataLocation", "Choose where to keep data on {node}")
    WaitsForQuota = _t("WaitsForQuota", "Waits for namespace quota: {resource} {used} in use + {asked} asked > {limit}")
    GangWaitsForQuota = _t(
        "GangWaitsForQuota", "Gang waits for namespace quota: {resource} {used} in use + {asked} asked > {limit}"
    )
    QuotaNeverEnough = _t(
        "QuotaNeverEnough",
        "Waits for more than the namespace's quota allows at all ({why}): raise the quota or ask for less",
    )
    WaitsForGroup = _t("WaitsForGroup", "Waits for worker group {group} to be {condition}")
    ArrayMaxParallel = _t("ArrayMaxParallel", "Array runs at most {k} workers at once")
    WaitingForFabric = _t(
        "WaitingForFabric",
        "Waiting up to {minutes} min more for InfiniBand fabric {fabric} (could start now on Ethernet)",
    )
    NextToRunStartsBy = _t(
        "NextToRunStartsBy", "Next to run (priority {priority}): starts by {time} UTC as running work ends"
    )
    NextToRunWaits = _t("NextToRunWaits", "Next to run (priority {priority}): waits for running work to end")
    QueuedBehindHigherPriority = _t("QueuedBehindHigherPriority", "Queued behind higher-priority work ({run})")
    QueuedBehindStartsBy = _t("QueuedBehindStartsBy", "Queued behind {run}, which starts by {time} UTC")
    QueuedBehind = _t("QueuedBehind", "Queued behind {run}")
    Preempting = _t("Preempting", "Preempting {k} lower-priority worker(s) of {runs} to start")
    WaitingForPreempted = _t("WaitingForPreempted", "Starting: waiting for {k} preempted worker(s) to stop")

    # --- Per-machine reasons (placement.nodes[].reasons) -----------------------------------------------------
    NodeNotReady = _t("NodeNotReady", "machine is not ready ({state})")
    NodeNoCapacity = _t("NodeNoCapacity", "machine is not ready (no capacity reported)")
    UnderPressure = _t("UnderPressure", "under pressure: {condition}")
    NotAcceptingRuns = _t("NotAcceptingRuns", "machine does not accept runs: {why}")
    Cordoned = _t("Cordoned", "machine is cordoned: {why}")
    NoAcceptedLabel = _t("NoAcceptedLabel", "worker carries none of the labels this machine accepts")
    NotSelectedName = _t("NotSelectedName", "machine is not among the selected names")
    LacksLabel = _t("LacksLabel", "machine lacks label {key}={value}")
    NoRdmaPort = _t("NoRdmaPort", "no active RDMA port")
    NoInfinibandPort = _t("NoInfinibandPort", "no active InfiniBand port at {speed} Gb/s or faster ({detail})")
    AnotherWorkerOnMachine = _t("AnotherWorkerOnMachine", "another worker of this run is already on the machine")
    InsufficientCpu = _t("InsufficientCpu", "insufficient cpu: need {need} cores, {free} free")
    InsufficientMemory = _t("InsufficientMemory", "insufficient memory: need {need} bytes, {free} free")
    InsufficientGpus = _t("InsufficientGpus", "insufficient gpus: need {need}, {free} free and usable")
    HealthyGpus = _t("HealthyGpus", "needs {need} healthy GPUs, {free} free ({at_risk} more free but at risk)")
    NoMatchingGpu = _t("NoMatchingGpu", "no {request} GPU")
    GpuFault = _t("GpuFault", "gpu fault on the machine: GPU {index}: {fault}")
    KeptOnOneMachine = _t("KeptOnOneMachine", "the run is kept on one machine, {node}")
    KeptWithinRack = _t("KeptWithinRack", "the run is kept within rack {rack}")
    NoRackLabel = _t("NoRackLabel", "no rack set on this machine (topology.astraeus.io/rack)")
    MaxMachines = _t("MaxMachines", "the run may use at most {n} machines")
    RackAlreadyUsed = _t("RackAlreadyUsed", "rack {rack} already has a worker of this run")
    DriveMissing = _t("DriveMissing", "drive {drive} does not exist")
    DriveProblem = _t("DriveProblem", "drive {drive}: {why}")
    DriveOtherSite = _t("DriveOtherSite", "drive {drive} is on {node}, in another site ({site})")
    DriveNoSpace = _t("DriveNoSpace", "drive {drive} needs {size} at this machine's data location, {free} free")
    NoOutboundPolicy = _t("NoOutboundPolicy", "machine cannot enforce an outbound policy ({why})")
    NoSandbox = _t("NoSandbox", "machine cannot run sandboxed workers ({why})")
    NoToolGateway = _t("NoToolGateway", "machine serves no tool gateway to its workers ({why})")

    # --- Astraeus additions (not in the spec's tables; documented in workflows/README.md) -----------------------
    # A per-machine reason for a worker with external_access on a machine whose agent assigns no ports (or fewer
    # than it asks), said as the spec's capability reasons are ("machine serves no tool gateway to its workers").
    NoExternalPorts = _t("NoExternalPorts", "machine exposes no external ports to its workers ({why})")
    # A per-machine reason for a worker asking for the node network (network.mesh) on a machine that cannot host it
    # (its runtime gives workers no network of their own), said as the spec's capability reasons are.
    NoNodeNetwork = _t("NoNodeNetwork", "machine cannot host the node network ({why})")
    RunDeleted = _t("RunDeleted", "Run deleted")  # the stop reason of a run being deleted: the spec gives none
    # The spec names no reason for a worker placed on a machine that has not picked it up yet (Pending; since
    # protocol 5, before which a placed worker was Preparing with it).
    Placed = _t("Placed", "Placed on {node}")
    # The spec's InfiniBand reason names a speed; a worker that asks for a fabric and no speed is told this.
    NoFabricPort = _t("NoFabricPort", "no active InfiniBand port on fabric {fabric} ({detail})")
    # Nor for a machine that picked a worker up and sets it up with nothing to wait for (Preparing): the spec's edge
    # "placed, machine picks it up".
    PickedUp = _t("PickedUp", "Picked up by {node}")
    # A machine's own history: its agent registered (Ready); Down uses MachineLost.
    NodeRegistered = _t("NodeRegistered", "Registered by its agent")
    # A long history keeps how it began and its latest changes; the middle is counted in one entry.
    HistorySummarised = _t("HistorySummarised", "{count} earlier changes summarised, from {first} to {last}")
    # A run whose workflow was terminated in Temporal (the UI's Terminate button): its workflow decides nothing more,
    # so clients show it Terminated with the reason Temporal recorded ("no reason given" when there was none).
    RunTerminated = _t("RunTerminated", "Its workflow was terminated in Temporal: {why}")
    # A machine's own history: why an admin removed it (`astraeus nodes remove --reason`, the console), before the
    # spec's "Machine removed from the cluster".
    RemovedByAdmin = _t("RemovedByAdmin", "An admin removes it: {why}")
    # A machine's own history: its agent stopped a worker whose run's workflow is closed, terminated or gone.
    OrphanStopped = _t("OrphanStopped", "Stopped worker {task} of run {run}: its run is no longer open ({status})")
    # A machine's own history: its agent stopped an attempt its (open) run no longer has there (it was lost with
    # the machine, or the run moved on to a new attempt): no worker runs twice.
    StaleAttemptStopped = _t(
        "StaleAttemptStopped", "Stopped worker {task} (attempt {attempt}) of run {run}: its run no longer has it here"
    )
    # A start the agent refused: its attempt is no longer the run's on this machine (fencing), so nothing starts.
    StartRefused = _t(
        "StartRefused", "Start refused: attempt {attempt} of worker {task} is no longer its run's ({why})"
    )
    # A waiting worker whose scheduling decision raised: set aside, so that the pass goes on for every other one.
    CannotBeScheduled = _t("CannotBeScheduled", "Cannot be scheduled: {error}")
    # A run whose next decision raised: it fails (its workers stopped) rather than wedge its workflow.
    CannotBeDecided = _t("CannotBeDecided", "Cannot be decided: {error}")
    # "Worker <w> failed on <machine>: <reason>" for a worker that failed for good with no machine to name: the
    # spec's sentence without its machine (every failure the lifecycle draws happens on one; this keeps the
    # sentence honest should one ever not).
    WorkerFailedNowhere = _t("WorkerFailedNowhere", "Worker {task} failed: {reason}")


ERROR_MAX_CHARS = 500  # an error in a reason: enough to find the bug, never a history's worth


def error_text(error: BaseException) -> str:
    """An unexpected error as a reason shows it: its kind and message, cut to ERROR_MAX_CHARS."""
    message = str(error)
    text = f"{type(error).__name__}: {message}" if message else type(error).__name__
    return text if len(text) <= ERROR_MAX_CHARS else text[: ERROR_MAX_CHARS - 3] + "..."


def number(value: float) -> str:
    """A quantity as reasons print it: exact, never in exponent form (bytes: 17179869184), and without float noise
    (cpu summed from tenths: 0.3, not 0.30000000000000004); cpu is kept to the millionth of a core."""
    if isinstance(value, int):
        return str(value)
    text = format(Decimal(repr(round(value, 6))), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def duration(seconds: float) -> str:
    """A duration as reasons print it: 45s, 2m, 1m30s, 1h, 2h5m."""
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else "", f"{secs}s" if secs else ""]
    return "".join(parts) or "0s"


def all_templates() -> list[Template]:
    """Every template, in the order of the spec."""
    return [value for value in vars(R).values() if isinstance(value, Template)]


class NodeReasons(BaseModel):
    """Why one machine does not take a waiting worker: each reason with its code, in the checks' order. The run
    keeps them (`TaskRecord.waiting_on`) and `describe` shows their sentences (`placement.nodes[]`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    reasons: list[Reason]

    @field_validator("reasons", mode="before")
    @classmethod
    def _sentences(cls, reasons: Any) -> Any:
        """Schedulers before reasons kept their codes sent sentences alone (histories hold them): such a reason
        has the code UNCODED."""
        if isinstance(reasons, list):
            return [Reason(UNCODED, r) if isinstance(r, str) else r for r in reasons]
        return reasons

    @property
    def texts(self) -> list[str]:
        """The sentences people read, in order."""
        return [reason.text for reason in self.reasons]
