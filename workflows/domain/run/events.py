"""What can happen to a run (events) and what it asks to be done (commands): the vocabulary of `decide`.

An event that a machine or the scheduler sends is the payload of its signal itself (`workflows/contracts.py`): its
fields are written once, here. Its `kind` tells events apart in the process and is left off the wire, where the
signal's name says it. Reasons travel whole (a Reason: code and sentence); the shapes sent before, when each signal
had a model of its own and a reason was a pair of fields, still decode (the before-validators below).
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from workflows.domain.reasons import NodeReasons, R, Reason
from workflows.domain.requests import TaskRequest
from workflows.domain.spec import GroupSpec


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Timer(StrEnum):
    """Why a timer was armed."""

    RESTART = "restart"  # a back-off (or a gang restart's wait) is over
    RESET = "reset"  # the worker stayed Running for the reset window
    STALE_TTL = "stale_ttl"  # a Stale worker was not heard from for its full TTL
    TIME_LIMIT = "time_limit"  # the worker ran for time_limit_seconds
    REPLAN = "replan"  # look again at a group that could not be planned (task_id: the group)
    BARRIER = "barrier"  # a gang waited at its barrier for the barrier timeout (task_id "", attempt: the round)


# ---- Events -----------------------------------------------------------------------------------------------------


class Created(_Msg):
    kind: Literal["created"] = "created"


def _pair(data: Any) -> Any:
    """A reason sent, before reasons travelled whole, as the fields `code` and `reason` (its sentence): one Reason
    (None when both are empty: a placement's answer that names a machine)."""
    if isinstance(data, dict) and ("code" in data or isinstance(data.get("reason"), str)):
        data = dict(data)
        code, text = data.pop("code", ""), data.pop("reason", "")
        data["reason"] = Reason(code, text) if code or text else None
    return data


class PlacementUpdate(_Msg):
    """The scheduler's answer for one worker (signal `placement`, and the `place` activity's result): a machine
    (and its address, how a gang's workers reach its leader), or why it waits with every machine's reasons, and
    `quota_reached` ("Quota reached: <why>") when it waits on its namespace's quota."""

    kind: Literal["placement"] = Field("placement", exclude=True)
    task_id: str
    attempt: int
    node: str | None = None
    address: str | None = None
    reason: Reason | None = None  # why it waits, when no machine is named
    nodes: list[NodeReasons] = Field(default_factory=list)
    quota_reached: Reason | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_reason(cls, data: Any) -> Any:
        return _pair(data)

    @field_validator("quota_reached", mode="before")
    @classmethod
    def _old_quota(cls, value: Any) -> Any:
        """Sent as its sentence alone before ("" for none)."""
        if isinstance(value, str):
            return Reason(R.QuotaReached.code, value) if value else None
        return value


class TaskStarted(_Msg):
    kind: Literal["started"] = "started"
    task_id: str
    attempt: int


class TaskReady(_Msg):
    """A gang member is set up (prepared, image pulled) and waits at the barrier; its machine picked it up at
    `picked_up_at` (None from agents before protocol 5)."""

    kind: Literal["ready"] = "ready"
    task_id: str
    attempt: int
    picked_up_at: datetime | None = None
    node_address: str | None = None  # network.mesh: the address its machine holds for it on the node network


class GroupPlanned(_Msg):
    """The scheduler's plan for a group asking total_gpus: `workers` of `gpus_per_worker`, or (0) why not."""

    kind: Literal["planned"] = "planned"
    group: str
    workers: int = 0
    gpus_per_worker: int = 0
    code: str = ""
    reason: str = ""


class StopConfirmed(_Msg):
    """The machine finished a stop of a worker that had no container (a gang member at the barrier)."""

    kind: Literal["stop_confirmed"] = "stop_confirmed"
    task_id: str
    attempt: int


class TaskHealth(_Msg):
    """The group's readiness check now passes (`healthy`) or stopped passing (signal `task_health`); `detail` says
    why it fails (the command's exit, the HTTP status, the connection error)."""

    kind: Literal["health"] = Field("health", exclude=True)
    task_id: str
    attempt: int
    healthy: bool
    detail: str = ""


class TaskProgress(_Msg):
    """The machine is setting the worker up (signal `task_progress`): a Preparing reason (a wait, or "Picked up by
    <machine>" when setting it up takes a while), or Pulling its image; it picked the worker up at `picked_up_at`."""

    kind: Literal["progress"] = Field("progress", exclude=True)
    task_id: str
    attempt: int
    pulling: bool = False
    reason: Reason
    picked_up_at: datetime | None = None

    @model_validator(mode="before")
    @classmethod
    def _old_reason(cls, data: Any) -> Any:
        return _pair(data)


class TaskSetupFailed(_Msg):
    kind: Literal["setup_failed"] = "setup_failed"
    task_id: str
    attempt: int
    reason: Reason


class TaskRunning(_Msg):
    """The machine reports one attempt of the worker running (signal `task_running`); `heartbeat` when a supervisor
    re-attached to it after a missed heartbeat; `started` when the report also says it was started (one activity,
    run_task, starts and watches it)."""

    kind: Literal["running"] = Field("running", exclude=True)
    task_id: str
    attempt: int
    heartbeat: bool = False
    started: bool = False  # the same activity started it: the container was started, and runs
    picked_up_at: datetime | None = None  # with `started`: when its machine picked it up (began to set it up)
    started_at: datetime | None = None  # with `started`: when the container was started
    # With `started`: where people reach its external access, name -> "<machine address>:<port its machine gave>".
    external: dict[str, str] = Field(default_factory=dict)
    node_address: str | None = None  # with `started`, on the node network (network.mesh): its address there

    @model_serializer(mode="wrap")
    def _without_empty_external(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A report of a worker without external access (or node address) is sent as it was before the field (a
        control plane of before reads it)."""
        data: dict[str, Any] = handler(self)
        if not self.external:
            data.pop("external", None)
        if self.node_address is None:
            data.pop("node_address", None)
        return data


class HeartbeatLate(_Msg):
    """The worker's supervisor missed its heartbeat deadline (the stale grace)."""

    kind: Literal["heartbeat_late"] = "heartbeat_late"
    task_id: str
    attempt: int


class TaskEnded(_Msg):
    """The machine saw the worker's process end (or found it gone)."""

    kind: Literal["ended"] = "ended"
    task_id: str
    attempt: int
    exit_code: int | None = None
    oom: bool = False
    not_found: bool = False
    log_tail: str = ""


class ExitedWhileLost(_Msg):
    """Machine `node` came back after being lost and read back that this attempt, which its run lost with it, had
    exited 0 meanwhile (signal `task_exited_while_lost`; the exit is kept on the machine)."""

    kind: Literal["exited_while_lost"] = Field("exited_while_lost", exclude=True)
    task_id: str
    attempt: int
    node: str


class TimerFired(_Msg):
    kind: Literal["timer"] = "timer"
    timer: Timer
    task_id: str
    attempt: int


class MachineLost(_Msg):
    """A machine's lease expired (or it was removed) at `lost_at`, on its NodeWorkflow's clock (signal
    `machine_lost`): its workers are Down, but for an attempt whose start was reported at or after `lost_at` (a new
    agent of the machine started it). None (senders and histories from before it) is about every worker there.
    A copy of a worker that ran there may run on until `fenced_at`, when its agent has surely stopped it: the worker
    is not started again before then. None: no such wait (a removed machine; senders from before the fence)."""

    kind: Literal["machine_lost"] = Field("machine_lost", exclude=True)
    node: str
    removed: bool = False
    lost_at: datetime | None = None
    fenced_at: datetime | None = None


class MachineHeard(_Msg):
    """Machine `node`'s lease (which carries its workers' liveness: workflows/domain/machine/liveness.py) is late
    since `at` (`late`: its running workers are Stale), or taken again (its Stale workers run on, and the watches of
    its workers are attached again). `new_agent`: another agent process holds it now (signal `machine_heard`)."""

    kind: Literal["machine_heard"] = Field("machine_heard", exclude=True)
    node: str
    late: bool
    at: datetime
    new_agent: bool = False


class CancelRequested(_Msg):
    kind: Literal["cancel"] = "cancel"
    deleting: bool = False  # the run is being deleted: its workers are stopped with "Run deleted"


class StopRequested(_Msg):
    kind: Literal["stop"] = "stop"
    task_id: str
    reason: str = R.StoppedByScheduler.template


class Preempt(_Msg):
    """The scheduler stops these workers for higher-priority work (signal `preempt`; `by`: its run, or a reason
    that hides it); they are queued again once gone, without spending their restart budget."""

    kind: Literal["preempt"] = Field("preempt", exclude=True)
    task_ids: list[str]
    by: str


Event = Annotated[
    Created
    | PlacementUpdate
    | TaskStarted
    | TaskReady
    | TaskHealth
    | StopConfirmed
    | GroupPlanned
    | TaskProgress
    | TaskSetupFailed
    | TaskRunning
    | HeartbeatLate
    | TaskEnded
    | ExitedWhileLost
    | TimerFired
    | MachineLost
    | MachineHeard
    | CancelRequested
    | StopRequested
    | Preempt,
    Field(discriminator="kind"),
]


# ---- Commands ---------------------------------------------------------------------------------------------------


class Place(_Msg):
    kind: Literal["place"] = "place"
    requests: list[TaskRequest]


class PlanGroup(_Msg):
    """Ask the scheduler how many workers a group asking `total_gpus` becomes (`request`: one of its workers)."""

    kind: Literal["plan"] = "plan"
    group: str
    request: TaskRequest
    total_gpus: int
    machines: int | None = None


class Release(_Msg):
    """Give back a worker's room (or its place in the queue) at the scheduler."""

    kind: Literal["release"] = "release"
    task_id: str
    attempt: int


class Start(_Msg):
    """Start the worker on its machine, then supervise it; with `barrier` (a gang member) only set it up: it
    waits at the barrier, and a second Start starts it once every member is ready."""

    kind: Literal["start"] = "start"
    task_id: str
    attempt: int
    node: str
    group: GroupSpec
    barrier: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    host_network: bool = False


class Supervise(_Msg):
    """Watch a worker that was started already (after a continue-as-new): re-attach, never start it again."""

    kind: Literal["supervise"] = "supervise"
    task_id: str
    attempt: int
    node: str


class Stop(_Msg):
    kind: Literal["stop"] = "stop"
    task_id: str
    attempt: int
    node: str


class ArmTimer(_Msg):
    kind: Literal["arm_timer"] = "arm_timer"
    timer: Timer
    task_id: str
    attempt: int
    at: datetime


Command = Annotated[Place | PlanGroup | Release | Start | Supervise | Stop | ArmTimer, Field(discriminator="kind")]
