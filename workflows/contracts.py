"""Every name that travels through Temporal, in one place: task queues, workflow ids and types, search attributes,
and typed stubs of the activities, signals, queries and updates, with the process and queue that serve each.

Workflows call activities through the stubs (`workflow.execute_activity(contracts.run_task, RunTaskInput(...))`),
so mypy checks what they send and get back; each implementation is defined with `@implements(stub)`, which gives
it the stub's name and makes mypy check its signature against the stub's. Senders of signals, queries and updates
go through `signal`, `query` and `update` with the typed descriptors below. `tests/test_contracts.py` checks that
every name a workflow calls is registered by the process that serves it, on the queue it is sent to.

The names on the wire never change: committed histories replay by them (`tests/histories/`), and running clusters
keep their workflows, queues and search attributes. The module imports temporalio, the standard library and the
messages only, so workflows may import it (sandbox-safe); the pure core (`workflows/domain/`) never does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

from temporalio import activity
from temporalio.common import (
    RetryPolicy,
    SearchAttributeKey,
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
)

from workflows.domain.constraints import Drive
from workflows.domain.drives import DriveReport, NewDrive
from workflows.domain.inventory import NodeView
from workflows.domain.machine.decisions import DataReported, GpusReported, OrphanStopped, PressureReported, Registered
from workflows.domain.mesh import MeshPeer
from workflows.domain.run.events import (
    ExitedWhileLost,
    MachineHeard,
    MachineLost,
    PlacementUpdate,
    Preempt,
    TaskHealth,
    TaskProgress,
    TaskRunning,
)
from workflows.domain.run.status import Folded, Status
from workflows.domain.run.views import Event, JobDescription
from workflows.domain.scheduling.lease import ClaimLease, SchedulerLease
from workflows.domain.scheduling.planning import TaskPlan
from workflows.domain.scheduling.quotas import Quota
from workflows.domain.spec import JobSpec
from workflows.domain.spec import job_id as job_id
from workflows.domain.tokens import Token
from workflows.domain.tombstones import Tombstone
from workflows.messages import (
    Attached,
    AttachInput,
    AttemptsOnNode,
    AttemptsQuery,
    CancelRunInput,
    CordonRequest,
    DataLocationRequest,
    DeletedFiles,
    DeleteRunFilesInput,
    DrivesChangedInput,
    DriveUsers,
    EndedRun,
    EndRunInput,
    ForgetRunInput,
    GrantSessionInput,
    HoldSchedulerLeaseInput,
    IssuedIdentity,
    IssueIdentityInput,
    LeaseInput,
    LoadSettingsInput,
    LoadSettingsResult,
    LogText,
    MeshPeersRequest,
    NodeChangedInput,
    NodeSubnet,
    PlaceInput,
    PlaceResult,
    PlanInput,
    QuotasChangedInput,
    ReadLogInput,
    ReleaseInput,
    RemoveDriveRequest,
    RemoveQuotaRequest,
    RevokeTokenRequest,
    RunTaskInput,
    SchedulerView,
    SessionGranted,
    StartTaskInput,
    StartTaskResult,
    StopTaskInput,
    StopTaskRequest,
    SubnetRequest,
    SuperviseInput,
    TaskExit,
    TombstonesQuery,
)

if TYPE_CHECKING:
    from temporalio.client import Client, WorkflowHandle

# ---- task queues ------------------------------------------------------------------------------------------------

CONTROL_TASK_QUEUE = "astraeus-control"  # every workflow; the control plane's activities (ControlWorker)
SCHEDULER_TASK_QUEUE = "astraeus-scheduler"  # the scheduler service's activities (scheduler_worker)


def node_task_queue(name: str) -> str:
    """The task queue the machine's agent polls (its workers' activities)."""
    return f"astraeus-node-{name}"


def scheduler_lease_task_queue(instance: str) -> str:
    """The task queue of the scheduler's lease: its holder's own ("host:pid:token"), polled by that process only."""
    return f"{SCHEDULER_TASK_QUEUE}@{instance}"


def lease_task_queue(name: str, holder: str | None) -> str:
    """The task queue of the machine's lease: its holder's own, so that no other agent of that name (one that lost
    the lease and came back) ever runs it; the machine's queue for an agent that gives no instance."""
    return f"{node_task_queue(name)}@{holder}" if holder else node_task_queue(name)


# ---- workflow types and ids -------------------------------------------------------------------------------------

JOB_WORKFLOW = "JobWorkflow"
NODE_WORKFLOW = "NodeWorkflow"
LOGS_WORKFLOW = "LogsWorkflow"
QUOTAS_WORKFLOW = "QuotasWorkflow"
TOKENS_WORKFLOW = "TokensWorkflow"
DELETE_RUN_WORKFLOW = "DeleteRunWorkflow"
DELETED_RUNS_WORKFLOW = "DeletedRunsWorkflow"
DRIVES_WORKFLOW = "DrivesWorkflow"
IDENTITY_WORKFLOW = "IdentityWorkflow"
SESSION_WORKFLOW = "SessionWorkflow"
SUBNETS_WORKFLOW = "SubnetsWorkflow"
SCHEDULER_LEASE_WORKFLOW = "SchedulerLeaseWorkflow"

QUOTAS_WORKFLOW_ID = "quotas"
TOKENS_WORKFLOW_ID = "tokens"  # the HTTP API's tokens (their digests), for every API process alike
DELETED_RUNS_WORKFLOW_ID = "deleted-runs"  # the tombstones of deleted runs
DRIVES_WORKFLOW_ID = "drives"  # the cluster's catalogue of drives
SUBNETS_WORKFLOW_ID = "subnets"  # the node network: each machine's subnet
SCHEDULER_LEASE_WORKFLOW_ID = "scheduler"  # the scheduler's lease: one scheduler places at a time

# Visibility queries of the open runs and machines.
OPEN_JOBS = f'WorkflowType="{JOB_WORKFLOW}" AND ExecutionStatus="Running"'
OPEN_NODES = f'WorkflowType="{NODE_WORKFLOW}" AND ExecutionStatus="Running"'

# `job_id(namespace, name)` is "job/<namespace>/<name>": it lives in the core (workflows/domain/spec.py), which keys
# runs by it and reads a run's namespace and name back from it; imported here with the other addresses.


def delete_id(namespace: str, name: str) -> str:
    """The workflow that deletes run `namespace/name` (one at a time per name; a name reused can be deleted again)."""
    return f"delete/{namespace}/{name}"


def logs_id_prefix(namespace: str, name: str) -> str:
    """The ids of the run's LogsWorkflows begin so (`logs/<ns>/<name>/<worker>/<uuid>`)."""
    return f"logs/{namespace}/{name}/"


def session_id_prefix(namespace: str, name: str) -> str:
    """The ids of the run's SessionWorkflows begin so (`session/<ns>/<name>/<worker>/<uuid>`)."""
    return f"session/{namespace}/{name}/"


def identity_id_prefix(namespace: str, name: str) -> str:
    """The ids of the run's IdentityWorkflows begin so (`identity/<ns>/<name>/<worker>/<attempt>/<serial>`)."""
    return f"identity/{namespace}/{name}/"


def identity_id(namespace: str, name: str, task: str, attempt: int, serial: str) -> str:
    """One issue of an attempt's certificate."""
    return f"{identity_id_prefix(namespace, name)}{task}/{attempt}/{serial}"


def node_id(name: str) -> str:
    """The machine's workflow id."""
    return f"node/{name}"


# ---- search attributes (registered by workers/connect.py and workers/devserver.py) ------------------------------

SA_NAMESPACE = "AstraeusNamespace"
SA_STATE = "AstraeusState"
SA_PRIORITY = "AstraeusPriority"
SA_NODES = "AstraeusNodes"  # machines that hold a worker of a protocol-1 run now

NAMESPACE_KEY = SearchAttributeKey.for_keyword(SA_NAMESPACE)
STATE_KEY = SearchAttributeKey.for_keyword(SA_STATE)
PRIORITY_KEY = SearchAttributeKey.for_int(SA_PRIORITY)
NODES_KEY = SearchAttributeKey.for_keyword_list(SA_NODES)


def search_attributes(spec: JobSpec, state: str) -> TypedSearchAttributes:
    """A run's listable attributes (set at start by the client, kept current by its workflow)."""
    return TypedSearchAttributes(
        [
            SearchAttributePair(NAMESPACE_KEY, spec.namespace),
            SearchAttributePair(STATE_KEY, state),
            SearchAttributePair(PRIORITY_KEY, spec.priority),
        ]
    )


# ---- calling activities: how a workflow retries them (how their failures read: workflows/activity_failures.py) -----

# The scheduler and agents come back after a crash: keep retrying calls to them, gently.
PATIENT = RetryPolicy(initial_interval=timedelta(seconds=1), maximum_interval=timedelta(seconds=10))
# A supervisor is never retried by Temporal: the workflow decides (a missed heartbeat makes the worker Stale).
ONCE = RetryPolicy(maximum_attempts=1)


# ---- activities -------------------------------------------------------------------------------------------------
# A stub's activity name (`activity_name`) is its function's name, or the name its `activity.defn` gives where the
# Python name changed since: the name on the wire never does. It is never run: the process named above it serves it.

P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def implements(
    stub: Callable[P, Awaitable[R]],
) -> Callable[[Callable[Concatenate[S, P], Awaitable[R]]], Callable[Concatenate[S, P], Awaitable[R]]]:
    """Define a method as the activity `stub` declares: its name, and (checked by mypy) what it takes and returns."""
    return activity.defn(name=activity_name(stub))


def activity_name(stub: Callable[..., Any]) -> str:
    """The name the stub's activity is registered and called by (what histories record)."""
    name = activity._Definition.must_from_callable(stub).name
    assert name is not None  # a stub is never dynamic
    return name


# What a run's queries answer before its first decision made its record (a client asks again).
BEING_CREATED = "the run is still being created"

# The control plane (CONTROL_TASK_QUEUE: local activities of its workflows, and the activities sent there).


@activity.defn
async def load_settings(input: LoadSettingsInput | None = None) -> LoadSettingsResult:
    """Local: the operator's settings and the protocol a new run uses, recorded in its history; given the run's spec,
    its first placement too (one local activity where there were two)."""
    raise NotImplementedError


@activity.defn
async def cancel_run_workflow(input: CancelRunInput) -> None:
    """Ask Temporal to cancel a run's workflow, so that a Cancelled run closes Canceled."""
    raise NotImplementedError


@activity.defn
async def place(input: PlaceInput) -> PlaceResult:
    """Ask the scheduler for room: a local activity of the control plane through the scheduler's door since
    protocol 3, an activity on SCHEDULER_TASK_QUEUE before."""
    raise NotImplementedError


@activity.defn
async def release(input: ReleaseInput) -> None:
    """Give a worker's room back to the scheduler; served as `place` is."""
    raise NotImplementedError


@activity.defn
async def end_run(input: EndRunInput) -> EndedRun:
    """A run being deleted: cancel it (its workers stopped with "Run deleted") and wait until its workflow closed."""
    raise NotImplementedError


@activity.defn
async def forget_run(input: ForgetRunInput) -> None:
    """Keep a deleted run's tombstone, then remove its workflow runs and its logs' workflows from Temporal."""
    raise NotImplementedError


@activity.defn
async def issue_identity(input: IssueIdentityInput) -> IssuedIdentity:
    """Sign an attempt's certificate with the cluster CA, whose key only this activity reads (IdentityWorkflow)."""
    raise NotImplementedError


# The scheduler service (SCHEDULER_TASK_QUEUE).


@activity.defn(name="plan_workers")
async def plan_group(input: PlanInput) -> TaskPlan:
    """How many tasks a group of `total_gpus` is split into, and of how many GPUs each."""
    raise NotImplementedError


@activity.defn
async def node_changed(input: NodeChangedInput) -> None:
    """A machine's view changed (registered, Down, cordoned, its GPUs or pressure)."""
    raise NotImplementedError


@activity.defn
async def quotas_changed(input: QuotasChangedInput) -> None:
    """The namespaces' quotas changed."""
    raise NotImplementedError


@activity.defn
async def drives_changed(input: DrivesChangedInput) -> None:
    """The catalogue of drives changed."""
    raise NotImplementedError


@activity.defn
async def drive_users(input: RemoveDriveRequest) -> DriveUsers:
    """The runs whose workers wait for or hold the drive (a drive in use is not removed)."""
    raise NotImplementedError


@activity.defn(name="machine_lost")
async def tell_runs_machine_lost(report: MachineLost) -> int:
    """Tell every run with room on the machine that it is gone (the signal `machine_lost`); how many were told. The
    control plane serves it too, for NodeWorkflow histories that sent it there."""
    raise NotImplementedError


@activity.defn(name="machine_heard")
async def tell_runs_machine_heard(report: MachineHeard) -> int:
    """Tell every run with room on the machine that its lease is late, or heard again (the signal `machine_heard`);
    how many were told."""
    raise NotImplementedError


# A machine's agent (node_task_queue(name)).


@activity.defn
async def use_data_location(input: DataLocationRequest) -> DataReported:
    """Keep copies of drives at this directory from now on; what is there (its free room, copies made before)."""
    raise NotImplementedError


@activity.defn
async def start_task(input: StartTaskInput) -> StartTaskResult:
    """Set a worker up (a gang member at the barrier), or start it (protocol 1)."""
    raise NotImplementedError


@activity.defn
async def run_task(input: RunTaskInput) -> TaskExit:
    """Start a worker and watch it until it ends (protocol 2 on)."""
    raise NotImplementedError


@activity.defn
async def supervise_task(input: SuperviseInput) -> TaskExit:
    """Watch a worker started before until it ends."""
    raise NotImplementedError


@activity.defn
async def stop_task(input: StopTaskInput) -> None:
    """The stop signal, the grace period, then a kill."""
    raise NotImplementedError


@activity.defn
async def read_log(input: ReadLogInput) -> LogText:
    """A worker's output, for `astraeus logs`."""
    raise NotImplementedError


@activity.defn
async def grant_session(input: GrantSessionInput) -> SessionGranted:
    """Let the holder of a token (its public key) run commands in a running attempt until it expires."""
    raise NotImplementedError


@activity.defn
async def attach_session(input: AttachInput) -> Attached:
    """Run a command in a running attempt, for a request signed by a token granted for it (`astraeus attach`)."""
    raise NotImplementedError


@activity.defn
async def delete_run_files(input: DeleteRunFilesInput) -> DeletedFiles:
    """Remove every attempt of a deleted run from this machine: its directory or container, its log, its files."""
    raise NotImplementedError


# The agent holding a machine's lease (lease_task_queue(name, holder)).


@activity.defn
async def hold_lease(input: LeaseInput) -> None:
    """The machine's lease: heartbeats while the agent lives."""
    raise NotImplementedError


# The scheduler holding its lease (scheduler_lease_task_queue(instance)).


@activity.defn
async def hold_scheduler_lease(input: HoldSchedulerLeaseInput) -> None:
    """The scheduler's lease: heartbeats while its holder lives and places."""
    raise NotImplementedError


# ---- signals, queries and updates -------------------------------------------------------------------------------

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass(frozen=True)
class Signal(Generic[In]):
    """A signal of workflow type `workflow`, carrying `input`."""

    workflow: str
    name: str
    input: type[In]


@dataclass(frozen=True)
class Query(Generic[In, Out]):
    """A query of workflow type `workflow`; `input` None when it takes no argument."""

    workflow: str
    name: str
    input: type[In] | None
    result: Any  # the type of its result (a `list[...]` is no `type` to mypy)


@dataclass(frozen=True)
class Update(Generic[In, Out]):
    """An update of workflow type `workflow`; `input` None when it takes no argument."""

    workflow: str
    name: str
    input: type[In] | None
    result: Any


# JobWorkflow's signals: the scheduler's answers and preemptions, the agents' reports, machine loss.
# Each carries the run's domain event itself (workflows/domain/run/events.py).
PLACEMENT = Signal(JOB_WORKFLOW, "placement", PlacementUpdate)
PREEMPT = Signal(JOB_WORKFLOW, "preempt", Preempt)
TASK_PROGRESS = Signal(JOB_WORKFLOW, "task_progress", TaskProgress)
TASK_RUNNING = Signal(JOB_WORKFLOW, "task_running", TaskRunning)
TASK_HEALTH = Signal(JOB_WORKFLOW, "task_health", TaskHealth)
MACHINE_LOST = Signal(JOB_WORKFLOW, "machine_lost", MachineLost)  # sent to each run by `tell_runs_machine_lost`
MACHINE_HEARD = Signal(JOB_WORKFLOW, "machine_heard", MachineHeard)  # sent by `tell_runs_machine_heard`
TASK_EXITED_WHILE_LOST = Signal(JOB_WORKFLOW, "task_exited_while_lost", ExitedWhileLost)

# JobWorkflow's updates and queries (clients, the scheduler's rebuild, the agents' fencing).
CANCEL: Update[None, Status] = Update(JOB_WORKFLOW, "cancel", None, Status)
# A person's (the API's) request to stop a task; `stop_task`, the activity, is its machine's stop.
REQUEST_STOP: Update[StopTaskRequest, Status] = Update(JOB_WORKFLOW, "stop_task", StopTaskRequest, Status)
DELETE: Update[None, Status] = Update(JOB_WORKFLOW, "delete", None, Status)  # cancel for a delete
STATUS: Query[None, Status] = Query(JOB_WORKFLOW, "status", None, Status)
DESCRIBE: Query[None, JobDescription] = Query(JOB_WORKFLOW, "describe", None, JobDescription)
EVENTS: Query[None, list[Event]] = Query(JOB_WORKFLOW, "events", None, list[Event])
FOLDED: Query[None, Folded] = Query(JOB_WORKFLOW, "folded", None, Folded)
ATTEMPTS_ON: Query[AttemptsQuery, AttemptsOnNode] = Query(JOB_WORKFLOW, "attempts_on", AttemptsQuery, AttemptsOnNode)
SCHEDULER_VIEW: Query[None, SchedulerView] = Query(JOB_WORKFLOW, "scheduler_view", None, SchedulerView)

# NodeWorkflow's updates (its agent, and `astraeus nodes`) and query; the agent's carry the machine's domain events
# (workflows/domain/machine/decisions.py).
REGISTER: Update[Registered, NodeView] = Update(NODE_WORKFLOW, "register", Registered, NodeView)
REPORT_GPUS: Update[GpusReported, NodeView] = Update(NODE_WORKFLOW, "report_gpus", GpusReported, NodeView)
REPORT_PRESSURE: Update[PressureReported, NodeView] = Update(
    NODE_WORKFLOW, "report_pressure", PressureReported, NodeView
)
REPORT_ORPHAN_STOPPED: Update[OrphanStopped, NodeView] = Update(
    NODE_WORKFLOW, "report_orphan_stopped", OrphanStopped, NodeView
)
REPORT_DATA: Update[DataReported, NodeView] = Update(NODE_WORKFLOW, "report_data", DataReported, NodeView)
SET_DATA_LOCATION: Update[DataLocationRequest, NodeView] = Update(
    NODE_WORKFLOW, "set_data_location", DataLocationRequest, NodeView
)
CORDON: Update[CordonRequest, NodeView] = Update(NODE_WORKFLOW, "cordon", CordonRequest, NodeView)
UNCORDON: Update[None, NodeView] = Update(NODE_WORKFLOW, "uncordon", None, NodeView)
REMOVE: Update[CordonRequest, NodeView] = Update(NODE_WORKFLOW, "remove", CordonRequest, NodeView)
VIEW: Query[None, NodeView] = Query(NODE_WORKFLOW, "view", None, NodeView)

# QuotasWorkflow's updates (`astraeus quota set|rm`) and query (the scheduler's rebuild).
SET_QUOTA: Update[Quota, list[Quota]] = Update(QUOTAS_WORKFLOW, "set_quota", Quota, list[Quota])
REMOVE_QUOTA: Update[RemoveQuotaRequest, list[Quota]] = Update(
    QUOTAS_WORKFLOW, "remove_quota", RemoveQuotaRequest, list[Quota]
)
QUOTAS: Query[None, list[Quota]] = Query(QUOTAS_WORKFLOW, "quotas", None, list[Quota])

# TokensWorkflow's updates (`astraeus token create|revoke`) and query (every `astraeus api`, to check a caller).
ADD_TOKEN: Update[Token, list[Token]] = Update(TOKENS_WORKFLOW, "add_token", Token, list[Token])
REVOKE_TOKEN: Update[RevokeTokenRequest, list[Token]] = Update(
    TOKENS_WORKFLOW, "revoke_token", RevokeTokenRequest, list[Token]
)
TOKENS: Query[None, list[Token]] = Query(TOKENS_WORKFLOW, "tokens", None, list[Token])

# DrivesWorkflow's updates (`astraeus drive create|rm`, machines' reports of their fills) and query (the scheduler's
# rebuild, a machine preparing a worker, `astraeus drive ls`).
CREATE_DRIVE: Update[NewDrive, list[Drive]] = Update(DRIVES_WORKFLOW, "create_drive", NewDrive, list[Drive])
REMOVE_DRIVE: Update[RemoveDriveRequest, list[Drive]] = Update(
    DRIVES_WORKFLOW, "remove_drive", RemoveDriveRequest, list[Drive]
)
REPORT_DRIVE: Update[DriveReport, list[Drive]] = Update(DRIVES_WORKFLOW, "report_drive", DriveReport, list[Drive])
DRIVES: Query[None, list[Drive]] = Query(DRIVES_WORKFLOW, "drives", None, list[Drive])

# SubnetsWorkflow's updates (a machine's agent asks for its subnet; removing a machine frees it) and query.
ASSIGN_SUBNET: Update[SubnetRequest, NodeSubnet] = Update(SUBNETS_WORKFLOW, "assign_subnet", SubnetRequest, NodeSubnet)
FREE_SUBNET: Update[SubnetRequest, list[NodeSubnet]] = Update(
    SUBNETS_WORKFLOW, "free_subnet", SubnetRequest, list[NodeSubnet]
)
SUBNETS: Query[None, list[NodeSubnet]] = Query(SUBNETS_WORKFLOW, "subnets", None, list[NodeSubnet])
# A machine's peers in the mesh (each other machine's public key, endpoint and subnet), asked by its agent at each look.
MESH_PEERS: Query[MeshPeersRequest, list[MeshPeer]] = Query(
    SUBNETS_WORKFLOW, "mesh_peers", MeshPeersRequest, list[MeshPeer]
)

# DeletedRunsWorkflow's update (a delete's last step) and query (the runs list, clients, returning machines).
ADD_TOMBSTONE: Update[Tombstone, Tombstone] = Update(DELETED_RUNS_WORKFLOW, "add_tombstone", Tombstone, Tombstone)
TOMBSTONES: Query[TombstonesQuery, list[Tombstone]] = Query(
    DELETED_RUNS_WORKFLOW, "tombstones", TombstonesQuery, list[Tombstone]
)

# SchedulerLeaseWorkflow's update (a scheduler process claims the lease: refused while another holds it) and query.
CLAIM: Update[ClaimLease, SchedulerLease] = Update(SCHEDULER_LEASE_WORKFLOW, "claim", ClaimLease, SchedulerLease)
LEASE: Query[None, SchedulerLease] = Query(SCHEDULER_LEASE_WORKFLOW, "lease", None, SchedulerLease)

SIGNALS = [PLACEMENT, PREEMPT, TASK_PROGRESS, TASK_RUNNING, TASK_HEALTH, MACHINE_LOST, MACHINE_HEARD]
SIGNALS += [TASK_EXITED_WHILE_LOST]
QUERIES = [STATUS, DESCRIBE, EVENTS, FOLDED, ATTEMPTS_ON, SCHEDULER_VIEW, VIEW, QUOTAS, TOKENS, TOMBSTONES, DRIVES]
QUERIES += [SUBNETS, MESH_PEERS, LEASE]
UPDATES = [
    CANCEL,
    REQUEST_STOP,
    REGISTER,
    REPORT_GPUS,
    REPORT_PRESSURE,
    REPORT_ORPHAN_STOPPED,
    REPORT_DATA,
    SET_DATA_LOCATION,
    CORDON,
    UNCORDON,
    REMOVE,
]
UPDATES += [SET_QUOTA, REMOVE_QUOTA, ADD_TOKEN, REVOKE_TOKEN, DELETE, ADD_TOMBSTONE]
UPDATES += [CREATE_DRIVE, REMOVE_DRIVE, REPORT_DRIVE, ASSIGN_SUBNET, FREE_SUBNET, CLAIM]


async def signal(handle: WorkflowHandle[Any, Any], sent: Signal[In], message: In) -> None:
    await handle.signal(sent.name, message)


async def query(handle: WorkflowHandle[Any, Any], asked: Query[In, Out], *args: In) -> Out:
    result: Out = await handle.query(asked.name, *args, result_type=asked.result)
    return result


async def update(handle: WorkflowHandle[Any, Any], sent: Update[In, Out], *args: In) -> Out:
    result: Out = await handle.execute_update(sent.name, *args, result_type=sent.result)
    return result


async def singleton(
    client: Client, workflow_type: str, input: Any, workflow_id: str, summary: str
) -> WorkflowHandle[Any, Any]:
    """The cluster's one workflow of a kind (quotas, tokens, deleted runs): started on the control plane's queue the
    first time it is needed, else the one that runs."""
    return await client.start_workflow(
        workflow_type,
        input,
        id=workflow_id,
        task_queue=CONTROL_TASK_QUEUE,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        static_summary=summary,
    )
