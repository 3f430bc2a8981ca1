"""A machine's decisions (workflows/domain/machine/decisions.py), pure: each event's next view and commands, and
each refusal."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from workflows.domain.inventory import DriveCopy, GpuInfo, NodeInventory, NodeState, NodeView
from workflows.domain.machine.decisions import (
    HISTORY_KEPT,
    Cordoned,
    DataLocationChosen,
    DataReported,
    GpusReported,
    LeaseExpired,
    NewLease,
    NodeCommand,
    NodeEvent,
    Notify,
    OrphanStopped,
    PressureReported,
    Registered,
    Removed,
    TellRuns,
    Uncordoned,
    check,
    decide_node,
)

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
GPU = GpuInfo(index=0, uuid="GPU-0", model="L4", memory_bytes=2**34)
INVENTORY = NodeInventory(name="m", cpus=8, memory_bytes=2**34, gpus=[GPU])
NEW = NodeView(name="m", state=NodeState.DOWN)
READY = NodeView(name="m", state=NodeState.READY, inventory=INVENTORY, holder="h:1:a")
REMOVED = READY.model_copy(update={"state": NodeState.REMOVED})


def entries(view: NodeView) -> list[tuple[str, str]]:
    return [(e.state, e.reason) for e in view.history]


CASES: list[tuple[str, NodeView, NodeEvent, str, list[tuple[str, str]], list[NodeCommand]]] = [
    (
        "an agent registers: Ready, and a new lease",
        NEW,
        Registered(inventory=INVENTORY, instance="h:1:a"),
        "Ready",
        [("Ready", "Registered by its agent")],
        [NewLease()],
    ),
    (
        "a GPU faults: recorded and told",
        READY,
        GpusReported(gpus=[GPU.model_copy(update={"fault": "Xid 79"})]),
        "Ready",
        [("Ready", "gpu fault on the machine: GPU 0: Xid 79")],
        [Notify()],
    ),
    ("GPUs at risk only: told, nothing recorded", READY, GpusReported(gpus=[GPU]), "Ready", [], [Notify()]),
    (
        "pressure begins: recorded and told",
        READY,
        PressureReported(pressure=["memory", "disk"]),
        "Ready",
        [("Ready", "under pressure: memory, disk")],
        [Notify()],
    ),
    ("pressure ends: told only", READY, PressureReported(pressure=[]), "Ready", [], [Notify()]),
    (
        "an orphan stopped: recorded only",
        READY,
        OrphanStopped(task="w-0", run="default/r", status="terminated"),
        "Ready",
        [("Ready", "Stopped worker w-0 of run default/r: its run is no longer open (terminated)")],
        [],
    ),
    (
        "a stale attempt stopped: recorded only",
        READY,
        OrphanStopped(task="w-0", run="default/r", status="open", attempt=2),
        "Ready",
        [("Ready", "Stopped worker w-0 (attempt 2) of run default/r: its run no longer has it here")],
        [],
    ),
    ("cordoned: told", READY, Cordoned(reason="disk swap"), "Ready", [], [Notify()]),
    (
        "removed: told, and its runs told",
        READY,
        Removed(),
        "Removed",
        [("Removed", "Machine removed from the cluster")],
        [Notify(), TellRuns(removed=True, lost_at=NOW)],
    ),
    (
        "removed with a reason: kept in its history",
        READY,
        Removed(reason="motherboard replaced"),
        "Removed",
        [("Ready", "An admin removes it: motherboard replaced"), ("Removed", "Machine removed from the cluster")],
        [Notify(), TellRuns(removed=True, lost_at=NOW)],
    ),
    (
        "its lease expires: Down, told, and its runs told",
        READY,
        LeaseExpired(),
        "Down",
        [("Down", "Machine lost: its lease expired")],
        [Notify(), TellRuns(removed=False, lost_at=NOW)],
    ),
    ("a removed machine's lease expires: it stays removed", REMOVED, LeaseExpired(), "Removed", [], []),
]


@pytest.mark.parametrize(
    ("view", "event", "state", "history", "commands"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_an_event_gives_the_machines_next_view_and_commands(
    view: NodeView, event: NodeEvent, state: str, history: list[tuple[str, str]], commands: list[NodeCommand]
) -> None:
    assert check(view, event) is None
    after, done = decide_node(view, event, NOW)
    assert (after.state, entries(after), done) == (state, history, commands)


def test_a_registration_keeps_the_inventory_and_its_agent_as_holder() -> None:
    after, _ = decide_node(NEW, Registered(inventory=INVENTORY, instance="h:1:a"), NOW)
    assert (after.inventory, after.holder, after.since) == (INVENTORY, "h:1:a", NOW)
    after, _ = decide_node(NEW, Registered(inventory=INVENTORY), NOW)
    assert after.holder is None  # an agent that names no instance holds the machine's own queue's lease


def test_an_expired_lease_is_no_ones_and_reports_keep_the_inventory_current() -> None:
    assert decide_node(READY, LeaseExpired(), NOW)[0].holder is None
    assert decide_node(REMOVED, LeaseExpired(), NOW)[0].holder is None
    after, _ = decide_node(READY, PressureReported(pressure=["disk"]), NOW)
    assert after.inventory is not None and after.inventory.pressure == ["disk"]
    again, _ = decide_node(after, PressureReported(pressure=["disk"]), NOW)
    assert entries(again) == entries(after)  # pressure still on: not recorded twice
    cordoned, _ = decide_node(READY, Cordoned(), NOW)
    assert cordoned.cordon == "no reason given"
    assert decide_node(cordoned, Uncordoned(), NOW)[0].cordon is None


def test_a_machines_history_keeps_its_latest_entries() -> None:
    view = READY
    for n in range(HISTORY_KEPT + 5):
        view, _ = decide_node(view, OrphanStopped(task=f"w-{n}", run="default/r", status="gone"), NOW)
    assert len(view.history) == HISTORY_KEPT
    assert view.history[-1].reason.startswith(f"Stopped worker w-{HISTORY_KEPT + 4} ")


REFUSALS: list[tuple[str, NodeView, NodeEvent, str | None, str]] = [
    (
        "an inventory of another machine",
        NEW,
        Registered(inventory=INVENTORY.model_copy(update={"name": "n"})),
        None,
        "inventory of n sent to machine m",
    ),
    (
        "a second agent while the first holds the lease",
        READY,
        Registered(inventory=INVENTORY, instance="h:2:b"),
        "LeaseHeld",
        "machine m is held by agent h:1:a, whose lease is live: stop that agent first, or give this one another --name",
    ),
    ("GPUs before it registered", NEW, GpusReported(gpus=[GPU]), "NotRegistered", "machine m has not registered"),
    ("other GPUs", READY, GpusReported(gpus=[]), None, "the GPUs reported are not those machine m registered"),
    (
        "pressure before it registered",
        NEW,
        PressureReported(pressure=[]),
        "NotRegistered",
        "machine m has not registered",
    ),
    (
        "an orphan before it registered",
        NEW,
        OrphanStopped(task="w-0", run="default/r", status="gone"),
        "NotRegistered",
        "machine m has not registered",
    ),
    ("uncordon while not cordoned", READY, Uncordoned(), "NotCordoned", "machine m is not cordoned"),
    ("cordon a removed machine", REMOVED, Cordoned(), "Removed", "machine m was removed"),
    ("remove a removed machine", REMOVED, Removed(), "Removed", "machine m was removed"),
]


@pytest.mark.parametrize(("view", "event", "type", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_an_event_the_machine_does_not_take_is_refused(
    view: NodeView, event: NodeEvent, type: str | None, message: str
) -> None:
    refusal = check(view, event)
    assert refusal is not None and (refusal.type, refusal.message) == (type, message)


def test_a_refusal_for_a_held_lease_names_its_holder_and_a_take_over_is_taken() -> None:
    refusal = check(READY, Registered(inventory=INVENTORY, instance="h:2:b"))
    assert refusal is not None and refusal.details == ("h:1:a",)
    assert check(READY, Registered(inventory=INVENTORY, instance="h:2:b", take_over="h:1:a")) is None
    assert check(READY, Registered(inventory=INVENTORY, instance="h:1:a")) is None


def test_a_data_report_keeps_the_room_and_copies_at_the_data_location_and_tells_the_scheduler() -> None:
    copy = DriveCopy(drive="imagenet", path="/srv/d/astraeus-drives/imagenet", size_bytes=10)
    report = DataReported(data_location="/srv/d", data_free_bytes=2**30, drive_copies=[copy])
    assert check(READY, report) is None
    view, commands = decide_node(READY, report, NOW)
    assert view.inventory is not None
    assert (view.inventory.data_location, view.inventory.data_free_bytes) == ("/srv/d", 2**30)
    assert view.inventory.drive_copies == [copy]
    assert commands == [Notify()]


def test_a_data_location_chosen_is_kept_by_the_machine_across_registrations() -> None:
    view, commands = decide_node(READY, DataLocationChosen(path="/srv/d"), NOW)
    assert (view.data_location, commands) == ("/srv/d", [])
    again, _ = decide_node(view, Registered(inventory=INVENTORY, instance="h:2:b"), NOW)
    assert again.data_location == "/srv/d"


@pytest.mark.parametrize(
    ("view", "path", "refusal"),
    [
        pytest.param(NEW, "/srv/d", "machine m has not registered", id="not registered"),
        pytest.param(REMOVED, "/srv/d", "machine m was removed", id="removed"),
        pytest.param(READY, "srv/d", "data location srv/d: not an absolute path", id="relative"),
    ],
)
def test_a_data_location_is_chosen_only_on_a_registered_machine_and_absolute(
    view: NodeView, path: str, refusal: str
) -> None:
    found = check(view, DataLocationChosen(path=path))
    assert found is not None and found.message == refusal
