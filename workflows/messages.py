"""One pydantic model per message between clients, workflows and activities (the names they travel by are in
`workflows/contracts.py`). A message that tells a workflow something happened is that workflow's domain event itself
(`workflows/domain/run/events.py` for runs, `workflows/domain/machine/decisions.py` for machines), not a copy of it:
those are not here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workflows.domain.constraints import Drive
from workflows.domain.group_parts import Readiness
from workflows.domain.inventory import NodeView
from workflows.domain.mesh import MeshMember
from workflows.domain.refs import TaskRef
from workflows.domain.run.events import PlacementUpdate
from workflows.domain.run.status import JobRecord
from workflows.domain.scheduling.lease import SchedulerLease
from workflows.domain.scheduling.placement import Allocation, TaskRequest
from workflows.domain.scheduling.quotas import Quota
from workflows.domain.settings import Settings
from workflows.domain.spec import GroupSpec, JobSpec
from workflows.domain.tokens import Token
from workflows.domain.tombstones import Tombstone


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---- JobWorkflow ------------------------------------------------------------------------------------------------


# What a control plane of this version does for the runs it creates. 1: a worker is started by `start_task`, then
# watched by `supervise_task` (two activities), and every run's workflow completes with its Status. 2: one activity,
# `run_task`, starts and watches a worker; machine loss is told by the scheduler (no AstraeusNodes); no reset timer
# for a count of 0; a Failed run's workflow fails and a Cancelled one's is Canceled. 3: `place` and `release` are
# local activities of the control plane, through the scheduler's door (activities/scheduler_link.py). 4: the entries
# folded out of a long history are kept (JobRecord.folded) and passed on at continue-as-new, which comes once one
# history has `history_keep` of them: clients serve the whole history from the runs of the workflow. 5: a placed
# worker stays Pending ("Placed on <machine>") until its machine picks it up, which the machine's reports say (with
# when): Preparing "Picked up by <machine>", or its first wait or pull. 6: the workflow keeps what is in flight by
# identity and, after each decision, runs the difference from what the record needs (workflows/domain/run/effects.py):
# it cancels the timers no longer needed (a time limit of an attempt that ended) and never arms a moot one. 7: a
# worker's watch has no heartbeat: its machine's lease carries its liveness (workflows/domain/machine/liveness.py), the
# run hears the lease late and heard again (signal `machine_heard`: Stale, Running), and attaches its watches there
# again when a new agent holds the machine.
PROTOCOL = 7


class LoadSettingsInput(_Msg):
    """A new run's spec, and when its workflow began: what its first decision will be (at `at`)."""

    spec: JobSpec
    at: datetime


class LoadSettingsResult(_Msg):
    """Local activity `load_settings`: the operator's settings and the protocol new runs use, recorded in each run's
    history when it starts, so a replay takes the same path. Histories from before it hold the bare settings: those
    runs use protocol 1. Asked for a new run (`LoadSettingsInput`), also what its first decision asks the scheduler
    (`requests`) and the scheduler's answers, so that the run needs no second call: histories without them place
    their first workers with `place`, as before. And the time it was asked at (`at`), when the run's first decision
    is taken: a replay reads it here, where its own clock may differ (workflows/job.py)."""

    settings: Settings
    protocol: int = 1
    requests: list[TaskRequest] = Field(default_factory=list)
    answers: list[PlacementUpdate] = Field(default_factory=list)
    at: datetime | None = None

    @model_validator(mode="before")
    @classmethod
    def _bare_settings(cls, data: Any) -> Any:
        if isinstance(data, dict) and "settings" not in data:
            return {"settings": data, "protocol": 1}
        return data


class JobInput(_Msg):
    """A new run (`spec`), or a run continued as new (`record` carries its whole state)."""

    spec: JobSpec
    record: JobRecord | None = None


# The type of the failure a Failed run's workflow ends with; its details carry the run's Status.
RUN_FAILED = "RunFailed"


class StopTaskRequest(_Msg):
    task_id: str
    reason: str | None = None


class CancelRunInput(_Msg):
    """Activity `cancel_run_workflow`: ask Temporal to cancel this execution of a run's workflow (its run ended
    Cancelled), so that it closes Canceled; `reason` is recorded with the request."""

    workflow_id: str
    run_id: str
    reason: str


class SchedulerView(_Msg):
    """What a run asks of the scheduler now: its waiting workers and what its placed ones hold."""

    job_id: str
    namespace: str
    pending: list[TaskRequest] = Field(default_factory=list)
    placed: list[Allocation] = Field(default_factory=list)


# ---- Scheduler activities ---------------------------------------------------------------------------------------


class PlaceInput(_Msg):
    requests: list[TaskRequest]


class ReleaseInput(_Msg):
    job_id: str
    task_id: str
    attempt: int


class NodeChangedInput(_Msg):
    node: NodeView


class PlaceResult(_Msg):
    """Activity `place`'s result: for each worker of the call, what the scheduler decided at once (a machine, or
    why it waits); what changes later comes by the `placement` signal."""

    answers: list[PlacementUpdate] = Field(default_factory=list)


class QuotasChangedInput(_Msg):
    """Activity `quotas_changed`: every namespace's quota, as the quotas workflow holds them now."""

    quotas: list[Quota]


class PlanInput(_Msg):
    """Activity `plan_workers` (`contracts.plan_group`): split `total_gpus` of a group into tasks (on exactly
    `machines` machines when given); `request` is one task of the group with everything but its GPU count."""

    request: TaskRequest
    total_gpus: int
    machines: int | None = None


# ---- QuotasWorkflow --------------------------------------------------------------------------------------------------


class QuotasInput(_Msg):
    quotas: list[Quota] = Field(default_factory=list)


class RemoveQuotaRequest(_Msg):
    namespace: str


# ---- DrivesWorkflow and machines' data locations --------------------------------------------------------------------


# ---- SubnetsWorkflow: the node network's subnets -------------------------------------------------------------------


class SubnetsInput(_Msg):
    """The subnets workflow's state: each machine's subnet, and the mesh's members (public key and endpoint), by
    machine."""

    assigned: dict[str, str] = Field(default_factory=dict)
    mesh: dict[str, MeshMember] = Field(default_factory=dict)


class SubnetRequest(_Msg):
    """A machine's agent asks for its subnet (`assign_subnet`), with its place in the mesh when it joins it (None: it
    joins none, and leaves it if it was in); an admin's removal frees both (`free_subnet`)."""

    node: str
    mesh: MeshMember | None = None


class MeshPeersRequest(_Msg):
    """A machine's agent asks for its peers in the mesh (`mesh_peers`)."""

    node: str


class NodeSubnet(_Msg):
    """A machine's subnet of the node network, or why it has none (every subnet of the range is held)."""

    node: str
    subnet: str | None = None
    why: str | None = None


class DrivesInput(_Msg):
    drives: list[Drive] = Field(default_factory=list)


class DrivesChangedInput(_Msg):
    """Activity `drives_changed`: every drive of the catalogue, as the drives workflow holds them now."""

    drives: list[Drive]


class RemoveDriveRequest(_Msg):
    name: str


class DriveUsers(_Msg):
    """Activity `drive_users`' answer: the runs ("<namespace>/<name>") whose workers wait for or hold the drive."""

    runs: list[str]


class DataLocationRequest(_Msg):
    """`astraeus nodes data-location MACHINE PATH`: where the machine keeps copies of drives."""

    path: str = Field(min_length=1, max_length=4096)


# ---- TokensWorkflow --------------------------------------------------------------------------------------------------


class TokensInput(_Msg):
    tokens: list[Token] = Field(default_factory=list)


class RevokeTokenRequest(_Msg):
    id: str


# ---- Deleting a run (DeleteRunWorkflow, DeletedRunsWorkflow) ----------------------------------------------------


class DeleteRunInput(_Msg):
    """Delete run `namespace/name`, as `by` asked (a token's id, or the CLI's user)."""

    namespace: str
    name: str
    by: str = Field(max_length=256)


class EndRunInput(_Msg):
    namespace: str
    name: str


class EndedRun(_Msg):
    """A run ended for its delete: the workflow run it is, what it ended as, and the machines that may hold its
    workers' files (every machine not Down; a Down one removes them when it comes back)."""

    run_id: str
    state: str
    reason: str = ""
    created_at: datetime | None = None
    machines: list[str] = Field(default_factory=list)


class DeleteRunFilesInput(_Msg):
    namespace: str
    job: str


class DeletedFiles(_Msg):
    attempts: int  # how many attempts' files (directories, containers, logs) were removed


class ForgetRunInput(_Msg):
    """Keep the run's tombstone, then remove its workflow runs (and its logs' workflows) from Temporal."""

    tombstone: Tombstone


class DeletedRunsInput(_Msg):
    tombstones: list[Tombstone] = Field(default_factory=list)


class TombstonesQuery(_Msg):
    """The tombstones of a namespace (None: all), of these runs (namespace, name) when given."""

    namespace: str | None = None
    runs: list[tuple[str, str]] | None = None


# ---- Node agent activities --------------------------------------------------------------------------------------


class StartTaskInput(_Msg):
    """Activity `start_task`. With `barrier` (a gang member) the machine admits, prepares and pulls, then returns
    without starting: the run calls it again once every member is ready. `env` is what the run adds to the
    group's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...)."""

    ref: TaskRef
    group: GroupSpec
    barrier: bool = False
    env: dict[str, str] = Field(default_factory=dict)
    host_network: bool = False  # a gang member shares its machine's network, so the others reach it


class StartTaskResult(_Msg):
    gpu_indices: list[int] = Field(default_factory=list)
    started: bool = True  # False: set up and waiting at the barrier (StartTaskInput.barrier)
    picked_up_at: datetime | None = None  # when the machine picked the worker up (began to set it up)
    # At the barrier, on the node network (network.mesh): the address its machine holds for it there (MASTER_ADDR)
    node_address: str | None = None


class SuperviseInput(_Msg):
    """Activity `supervise_task`; with `readiness` the machine checks the worker's health while it runs."""

    ref: TaskRef
    settings: Settings
    reattach: bool = False
    readiness: Readiness | None = None


class RunTaskInput(_Msg):
    """Activity `run_task`: a worker's whole life on its machine in one activity: start it (as `start_task`),
    report it running, then supervise it (as `supervise_task`) until it ends."""

    start: StartTaskInput
    settings: Settings
    readiness: Readiness | None = None


class TaskExit(_Msg):
    exit_code: int | None = None
    oom: bool = False
    not_found: bool = False
    log_tail: str = ""


class AttemptsQuery(_Msg):
    """Query `attempts_on` of a run: which of its attempts it has on machine `node` now."""

    node: str


class AttemptsOnNode(_Msg):
    """A run's answer to `attempts_on`: whether it is still open, and the attempt of each of its workers placed on
    the machine (by worker id). An agent starts, and keeps running, only the attempts a run has there (fencing)."""

    open: bool
    attempts: dict[str, int] = Field(default_factory=dict)


class StopTaskInput(_Msg):
    ref: TaskRef
    grace_seconds: float


class LeaseInput(_Msg):
    node: str
    renew_seconds: float


class HoldSchedulerLeaseInput(_Msg):
    """Activity `hold_scheduler_lease`, on the holder's own queue: the lease of epoch `epoch`, renewed every
    `renew_seconds`."""

    instance: str
    epoch: int
    renew_seconds: float


class ReadLogInput(_Msg):
    """Activity `read_log`: the last `lines` lines of an attempt's output, at most `max_bytes` of it."""

    ref: TaskRef
    lines: int = Field(ge=1)
    max_bytes: int = Field(ge=1)


class LogText(_Msg):
    text: str


class LogsInput(_Msg):
    """LogsWorkflow: read an attempt's output on the machine that ran it."""

    node: str
    read: ReadLogInput
    answer_within_seconds: float = Field(20, gt=0, description="How long a person waits for the machine.")


SESSION_TTL_MAX_SECONDS = 7 * 24 * 3600  # a token lives at most a week (and never longer than its attempt)
SESSION_OUTPUT_MAX_BYTES = 512 * 1024  # of each of a command's stdout and stderr: the rest is cut (payloads <= 2 MB)
SESSION_TIMEOUT_MAX_SECONDS = 3600


class GrantSessionInput(_Msg):
    """Activity `grant_session`: let the holder of a token run commands in an attempt until it expires. Only the
    token's public key travels; its private half stays with the person (`activities/session_token.py`)."""

    ref: TaskRef
    public_key: str = Field(min_length=1, max_length=64)
    ttl_seconds: int = Field(ge=1, le=SESSION_TTL_MAX_SECONDS)


class SessionGranted(_Msg):
    expires_at: datetime


class AttachInput(_Msg):
    """Activity `attach_session`: run `argv` in a running attempt, with `stdin` as its input, signed by a token
    granted for that attempt (`public_key`, `signature`); the machine runs each `nonce` once."""

    ref: TaskRef
    argv: list[str] = Field(min_length=1, max_length=4096)
    stdin: str = Field("", max_length=SESSION_OUTPUT_MAX_BYTES)
    timeout_seconds: float = Field(60, gt=0, le=SESSION_TIMEOUT_MAX_SECONDS)
    nonce: str = Field(min_length=16, max_length=64)
    signed_at: datetime
    public_key: str = Field("", max_length=64)
    signature: str = Field("", max_length=128)


class Attached(_Msg):
    """What a command run in a worker gave back: its exit code and its output (each cut at the start beyond
    SESSION_OUTPUT_MAX_BYTES, said in `cut`)."""

    exit_code: int
    stdout: str
    stderr: str
    cut: bool = False


class SessionInput(_Msg):
    """SessionWorkflow: a grant or an attach, on the machine of the attempt (`node`); exactly one of them."""

    node: str
    grant: GrantSessionInput | None = None
    attach: AttachInput | None = None
    answer_within_seconds: float = Field(20, gt=0, description="How long a person waits for the machine.")

    @model_validator(mode="after")
    def _one(self) -> SessionInput:
        if (self.grant is None) == (self.attach is None):
            raise ValueError("a session request is a grant or an attach, one of them")
        return self


class SessionOutput(_Msg):
    granted: SessionGranted | None = None
    attached: Attached | None = None


class IssueIdentityInput(_Msg):
    """IdentityWorkflow: a certificate for one attempt, asked by the machine it is on (`node`), for the key of the
    certificate request it sends (the key itself never leaves the machine)."""

    ref: TaskRef
    node: str
    csr_pem: str


class IssuedIdentity(_Msg):
    """The attempt's certificate and the CA's, PEM (public: neither holds a key)."""

    cert_pem: str
    bundle_pem: str


# ---- NodeWorkflow -----------------------------------------------------------------------------------------------


class NodeInput(_Msg):
    name: str
    settings: Settings = Field(default_factory=Settings)
    view: NodeView | None = None
    # The former run held the lease of `view.holder` when it continued as new: this one holds it on at once, telling
    # no one (the agent's former lease activity ends without counting the lease lost).
    lease_held: bool = False


# ---- SchedulerLeaseWorkflow -------------------------------------------------------------------------------------


class SchedulerLeaseInput(_Msg):
    """The scheduler's lease workflow: new (no lease yet), or continued as new with the lease as it was (`lease`,
    held by no one: it continues as new only between leases)."""

    lease: SchedulerLease = Field(default_factory=SchedulerLease)


class CordonRequest(_Msg):
    """Updates `cordon` (no new work; what runs stays) and `remove` (the machine leaves the cluster)."""

    reason: str = ""
