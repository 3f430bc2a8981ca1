"""One machine's decisions, pure: `check(view, event)` says whether the machine's workflow takes an event (an update's
validator), and `decide_node(view, event, now)` returns the machine's next view and the commands NodeWorkflow carries
out. The workflow holds the lease and sequences the commands; what the machine becomes is decided here."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from workflows.domain.inventory import DriveCopy, GpuInfo, NodeInventory, NodeState, NodeStatusEntry, NodeView
from workflows.domain.reasons import R, Reason

HISTORY_KEPT = 50  # a machine's history keeps its latest entries


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---- Events -----------------------------------------------------------------------------------------------------
# Those an agent sends are its updates' inputs themselves (workflows/contracts.py): their fields are written once.


class Registered(_Msg):
    """Its agent (re)started and registers the machine (update `register`). `instance` ("host:pid:token", "" for an
    agent that gives none) names that agent process: while another instance holds the machine's lease, the
    registration is refused, naming it, unless it takes over from that one (`take_over`: an agent of the same host
    whose process is gone)."""

    inventory: NodeInventory
    instance: str = ""
    take_over: str = ""


class GpusReported(_Msg):
    """The machine's GPUs with their health now, a fault or at risk (update `report_gpus`)."""

    gpus: list[GpuInfo]


class PressureReported(_Msg):
    """The machine's pressure conditions now, "memory", "disk"; empty: none (update `report_pressure`)."""

    pressure: list[str]


class DataReported(_Msg):
    """Where the machine keeps copies of drives, the room left there, and the copies it holds (update `report_data`,
    after a copy is filled or the place changed; and the answer of activity `use_data_location`)."""

    data_location: str | None
    data_free_bytes: int | None
    drive_copies: list[DriveCopy] = []


class DataLocationChosen(_Msg):
    """An admin chose where the machine keeps data (`astraeus nodes data-location`); its agent took it."""

    path: str


class OrphanStopped(_Msg):
    """The agent stopped worker `task` of run `run` ("<namespace>/<name>") because the run's workflow is no longer
    open; `status` says how Temporal has it ("terminated", "not found", ...) (update `report_orphan_stopped`). With
    `attempt`, the run is open but no longer has that attempt on the machine (it moved on: the attempt is stale)."""

    task: str
    run: str
    status: str
    attempt: int | None = None  # set when the run is open but no longer has this attempt on the machine


class Cordoned(_Msg):
    reason: str = ""


class Uncordoned(_Msg):
    pass


class Removed(_Msg):
    reason: str = ""  # the admin's, kept in the machine's history; its state's reason is the spec's


class LeaseExpired(_Msg):
    """The lease of the latest registration timed out: its agent stopped renewing it. Its workers may run on until
    `fenced_at` (`workflows/domain/machine/fence.py`); None: expired before the fence (replayed histories)."""

    fenced_at: datetime | None = None


NodeEvent = (
    Registered
    | GpusReported
    | PressureReported
    | DataReported
    | DataLocationChosen
    | OrphanStopped
    | Cordoned
    | Uncordoned
    | Removed
    | LeaseExpired
)


# ---- Commands ---------------------------------------------------------------------------------------------------


class Notify(_Msg):
    """Tell the scheduler the machine's view (activity `node_changed`)."""


class TellRuns(_Msg):
    """Every run with a worker on the machine learns it is gone, and since when (activity `machine_lost`)."""

    removed: bool
    lost_at: datetime
    fenced_at: datetime | None = None  # until when its workers may still run there (its agent's fence)


class NewLease(_Msg):
    """A new lease replaces the old one: the workflow cancels the old and, in its loop, tells the scheduler and holds
    the new one on its holder's queue."""


NodeCommand = Notify | TellRuns | NewLease


class Refusal(_Msg):
    """Why an event is refused, as the validator raises it: a message, an error type, and its details."""

    message: str
    type: str | None = None
    details: tuple[str, ...] = ()


# ---- Decisions --------------------------------------------------------------------------------------------------


def check(view: NodeView, event: NodeEvent) -> Refusal | None:
    """Whether the machine takes `event` now; None when it does."""
    name = view.name
    match event:
        case Registered(inventory=inventory, instance=instance, take_over=take_over):
            if inventory.name != name:
                return Refusal(message=f"inventory of {inventory.name} sent to machine {name}")
            holder = view.holder
            if holder and instance != holder and take_over != holder:
                # Two agents of one machine would both take its workers' activities: the second one is refused.
                return Refusal(
                    message=f"machine {name} is held by agent {holder}, whose lease is live: stop that agent first, "
                    "or give this one another --name",
                    type="LeaseHeld",
                    details=(holder,),
                )
        case GpusReported(gpus=gpus):
            if view.inventory is None:
                return _not_registered(name)
            if [(g.index, g.uuid) for g in gpus] != [(g.index, g.uuid) for g in view.inventory.gpus]:
                return Refusal(message=f"the GPUs reported are not those machine {name} registered")
        case PressureReported() | OrphanStopped() | DataReported():
            if view.inventory is None:
                return _not_registered(name)
        case DataLocationChosen(path=path):
            if view.state is NodeState.REMOVED:
                return Refusal(message=f"machine {name} was removed", type="Removed")
            if view.inventory is None:
                return _not_registered(name)
            if not path.startswith("/"):
                return Refusal(message=f"data location {path}: not an absolute path")
        case Uncordoned():
            if view.cordon is None:
                return Refusal(message=f"machine {name} is not cordoned", type="NotCordoned")
        case Cordoned() | Removed():
            if view.state is NodeState.REMOVED:
                return Refusal(message=f"machine {name} was removed", type="Removed")
    return None


def decide_node(view: NodeView, event: NodeEvent, now: datetime) -> tuple[NodeView, list[NodeCommand]]:
    """The machine's next view after `event` (one `check` took), and what the workflow must do."""
    match event:
        case Registered(inventory=inventory, instance=instance):
            # The agent (re)starts: record what the machine has, and take a new lease.
            view = view.model_copy(update={"inventory": inventory, "holder": instance or None})
            return _change(view, NodeState.READY, R.NodeRegistered(), now), [NewLease()]
        case GpusReported(gpus=gpus):
            # Keep the GPUs and their health current; each new fault goes in the machine's history.
            assert view.inventory is not None
            before = {gpu.index: gpu for gpu in view.inventory.gpus}
            view = _inventory(view, gpus=gpus)
            for gpu in gpus:
                if gpu.fault is not None and gpu.fault != before[gpu.index].fault:
                    view = _note(view, R.GpuFault(index=gpu.index, fault=gpu.fault), now)
            return view, [Notify()]
        case PressureReported(pressure=pressure):
            # The scheduler places nothing new on a machine under pressure; new pressure goes in its history.
            assert view.inventory is not None
            was = view.inventory.pressure
            view = _inventory(view, pressure=pressure)
            if pressure and set(pressure) - set(was):
                view = _note(view, R.UnderPressure(condition=", ".join(pressure)), now)
            return view, [Notify()]
        case DataReported(data_location=location, data_free_bytes=free, drive_copies=copies):
            # Room at its data location decides where drives held elsewhere may be copied; copies made are reused.
            return _inventory(view, data_location=location, data_free_bytes=free, drive_copies=copies), [Notify()]
        case DataLocationChosen(path=path):
            # Kept by the machine's workflow: an agent that registers again is told it (its answer carries it).
            return view.model_copy(update={"data_location": path}), []
        case OrphanStopped(task=task, run=run, status=status, attempt=attempt):
            # The agent stopped a worker whose run no longer has it there: its history says which, and why.
            if attempt is not None:
                return _note(view, R.StaleAttemptStopped(task=task, attempt=attempt, run=run), now), []
            return _note(view, R.OrphanStopped(task=task, run=run, status=status), now), []
        case Cordoned(reason=reason):
            # No new work here (what runs stays) until it is uncordoned.
            return view.model_copy(update={"cordon": reason or "no reason given"}), [Notify()]
        case Uncordoned():
            return view.model_copy(update={"cordon": None}), [Notify()]
        case Removed(reason=why):
            # The scheduler forgets the machine and its workers go Down; an agent that registers brings it back.
            view = _note(view, R.RemovedByAdmin(why=why), now) if why else view
            return _change(view, NodeState.REMOVED, R.MachineRemoved(), now), [
                Notify(),
                TellRuns(removed=True, lost_at=now),
            ]
        case LeaseExpired():
            # The lease is no one's any more; a removed machine stays removed, any other is lost (Down).
            view = view.model_copy(update={"holder": None})
            if view.state is NodeState.REMOVED:
                return view, []
            return _change(view, NodeState.DOWN, R.MachineLost(), now), [
                Notify(),
                TellRuns(removed=False, lost_at=now, fenced_at=event.fenced_at),
            ]


def _not_registered(name: str) -> Refusal:
    return Refusal(message=f"machine {name} has not registered", type="NotRegistered")


def _inventory(view: NodeView, **update: object) -> NodeView:
    assert view.inventory is not None
    return view.model_copy(update={"inventory": view.inventory.model_copy(update=update)})


def _change(view: NodeView, state: NodeState, reason: Reason, now: datetime) -> NodeView:
    return _note(view.model_copy(update={"state": state, "since": now}), reason, now)


def _note(view: NodeView, reason: Reason, now: datetime) -> NodeView:
    """A history entry in the machine's current state (its latest HISTORY_KEPT are kept)."""
    entry = NodeStatusEntry(state=view.state, reason=reason.text, at=now)
    return view.model_copy(update={"history": [*view.history, entry][-HISTORY_KEPT:]})
