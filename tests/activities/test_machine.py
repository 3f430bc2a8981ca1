"""The agent's readers of its machine on fake trees: RDMA ports from sysfs, declared ports, pressure from
/proc/meminfo and statvfs, and the data location's free space; and the inventory an agent registers with them."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Callable, Collection
from contextlib import suppress
from pathlib import Path
from typing import Any, cast

import pytest
from temporalio.client import Client
from temporalio.testing import ActivityEnvironment

from activities.agent import AgentActivities
from activities.agent.lease import EXPIRED
from activities.agent.machine import (
    MachineReadError,
    PressureWatch,
    data_free_bytes,
    disk_pressure,
    free_bytes,
    memory_pressure,
    parse_port,
    port_active,
    rate_gbps,
    read_rdma_ports,
    subnet_prefix,
)
from activities.agent.prepare import Preparer
from activities.agent.runtime.process import ProcessRuntime
from workers.agent_process import AgentOptions, inventory
from workflows.domain.inventory import NetworkPort, NodeInventory
from workflows.domain.machine.decisions import PressureReported
from workflows.messages import LeaseInput

GID = "fe80:0000:0000:0000:0c42:a103:0065:3d2e"


def fake_port(
    sysfs: Path, device: str, port: int, state: str, rate: str, link: str = "InfiniBand", gid: str = GID
) -> None:
    root = sysfs / "class" / "infiniband" / device / "ports" / str(port)
    (root / "gids").mkdir(parents=True)
    (root / "state").write_text(f"{state}\n")
    (root / "rate").write_text(f"{rate}\n")
    (root / "link_layer").write_text(f"{link}\n")
    (root / "gids" / "0").write_text(f"{gid}\n")


def meminfo(procfs: Path, total_kb: int, available_kb: int | None) -> Path:
    procfs.mkdir(exist_ok=True)
    lines = [f"MemTotal:       {total_kb} kB", "MemFree:          123456 kB"]
    if available_kb is not None:
        lines.append(f"MemAvailable:   {available_kb} kB")
    # Whole or not at all, as the kernel's file reads: an agent looking while it is rewritten must not see it empty.
    (procfs / "meminfo.tmp").write_text("\n".join([*lines, "Buffers:           2048 kB", ""]))
    (procfs / "meminfo.tmp").replace(procfs / "meminfo")
    return procfs


# ---- sysfs ----------------------------------------------------------------------------------------------------------


def test_ports_are_read_from_sysfs_with_their_state_speed_link_and_subnet(tmp_path: Path) -> None:
    fake_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    fake_port(tmp_path, "mlx5_1", 1, "1: DOWN", "100 Gb/sec (4X EDR)", gid="fe80:0000:0000:0001:0:0:0:1")
    fake_port(tmp_path, "mlx5_2", 1, "4: ACTIVE", "100 Gb/sec (2X HDR)", link="Ethernet")
    assert read_rdma_ports(tmp_path) == [
        NetworkPort(name="mlx5_0/1", link="InfiniBand", active=True, speed_gbps=200, fabric="fe80:0000:0000:0000"),
        NetworkPort(name="mlx5_1/1", link="InfiniBand", active=False, speed_gbps=100, fabric="fe80:0000:0000:0001"),
        NetworkPort(name="mlx5_2/1", link="Ethernet", active=True, speed_gbps=100, fabric=None),
    ]


def test_a_named_fabric_replaces_the_subnet_prefix_of_infiniband_ports_only(tmp_path: Path) -> None:
    fake_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)")
    fake_port(tmp_path, "mlx5_1", 1, "4: ACTIVE", "25 Gb/sec (1X EDR)", link="Ethernet")
    ports = read_rdma_ports(tmp_path, ib_fabric="ib-0")
    assert [(p.name, p.fabric) for p in ports] == [("mlx5_0/1", "ib-0"), ("mlx5_1/1", None)]


def test_ports_are_ordered_by_number_within_a_device(tmp_path: Path) -> None:
    for n in (10, 2, 1):
        fake_port(tmp_path, "mlx5_0", n, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    assert [p.name for p in read_rdma_ports(tmp_path)] == ["mlx5_0/1", "mlx5_0/2", "mlx5_0/10"]


def test_a_machine_without_rdma_devices_has_no_ports(tmp_path: Path) -> None:
    assert read_rdma_ports(tmp_path) == []


def test_an_unreadable_port_is_left_out_and_the_rest_are_read(tmp_path: Path) -> None:
    fake_port(tmp_path, "mlx5_0", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    fake_port(tmp_path, "mlx5_1", 1, "4: ACTIVE", "weird")
    fake_port(tmp_path, "mlx5_2", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    (tmp_path / "class" / "infiniband" / "mlx5_2" / "ports" / "1" / "link_layer").unlink()
    assert [p.name for p in read_rdma_ports(tmp_path)] == ["mlx5_0/1"]


@pytest.mark.parametrize(
    ("state", "active"),
    [("4: ACTIVE", True), ("1: DOWN", False), ("2: INIT", False), ("3: ARMED", False), ("", False)],
    ids=["active", "down", "init", "armed", "empty"],
)
def test_only_an_active_state_is_active(state: str, active: bool) -> None:
    assert port_active(state) is active


@pytest.mark.parametrize(
    ("rate", "gbps"),
    [("200 Gb/sec (4X HDR)", 200), ("2.5 Gb/sec (1X SDR)", 2), ("400 Gb/sec (4X NDR)\n", 400)],
    ids=["hdr", "a fraction rounds down", "trailing newline"],
)
def test_rates_read_in_whole_gigabits(rate: str, gbps: int) -> None:
    assert rate_gbps(rate) == gbps


def test_an_unreadable_rate_or_gid_is_an_error() -> None:
    with pytest.raises(MachineReadError, match="unreadable rate"):
        rate_gbps("Unknown")
    with pytest.raises(MachineReadError, match="unreadable GID"):
        subnet_prefix("fe80::1")


# ---- declared ports -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("declared", "port"),
    [
        ("mlx5_0:InfiniBand:100:ib-0", NetworkPort(name="mlx5_0", speed_gbps=100, fabric="ib-0")),
        ("mlx5_0:infiniband:200", NetworkPort(name="mlx5_0", speed_gbps=200)),
        ("eth2:RoCE:100", NetworkPort(name="eth2", link="Ethernet", speed_gbps=100)),
        ("eth2:Ethernet:25", NetworkPort(name="eth2", link="Ethernet", speed_gbps=25)),
    ],
    ids=["with a fabric", "without one", "roce is ethernet", "ethernet"],
)
def test_a_declared_port_is_active(declared: str, port: NetworkPort) -> None:
    assert parse_port(declared) == port


@pytest.mark.parametrize(
    ("declared", "error"),
    [
        ("mlx5_0", "expected NAME:LINK:SPEED"),
        (":InfiniBand:100", "expected NAME:LINK:SPEED"),
        ("mlx5_0:InfiniBand:fast", "is not a whole number"),
        ("mlx5_0:Token:100", "unknown link layer 'Token'"),
        ("eth2:Ethernet:100:ib-0", "only an InfiniBand port is on a fabric"),
    ],
    ids=["name alone", "no name", "speed not a number", "unknown link", "ethernet on a fabric"],
)
def test_a_bad_declared_port_says_what_is_wrong(declared: str, error: str) -> None:
    with pytest.raises(MachineReadError, match=error):
        parse_port(declared)


# ---- pressure and room ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("available_kb", "under"),
    [(1_000_000, False), (50_000, False), (49_999, True), (None, False)],
    ids=["plenty", "exactly 5%", "below 5%", "a kernel without MemAvailable"],
)
def test_memory_pressure_is_less_than_5_percent_available(
    tmp_path: Path, available_kb: int | None, under: bool
) -> None:
    assert memory_pressure(meminfo(tmp_path, 1_000_000, available_kb)) is under


def test_disk_pressure_and_free_space_come_from_statvfs() -> None:
    stat = os.statvfs(".")
    expected = stat.f_bavail < 0.05 * stat.f_blocks
    assert disk_pressure(Path(".")) is expected
    assert free_bytes(Path(".")) == stat.f_bavail * stat.f_frsize


def test_a_data_dir_not_made_yet_is_judged_by_its_nearest_parent(tmp_path: Path) -> None:
    assert disk_pressure(tmp_path / "not" / "yet") is disk_pressure(tmp_path)


def test_the_watch_names_each_condition(tmp_path: Path) -> None:
    procfs = meminfo(tmp_path / "proc", 1_000_000, 10_000)
    watch = PressureWatch(tmp_path, procfs)
    under_disk = disk_pressure(tmp_path)  # this machine's real disk
    assert watch.poll() == ["memory", *(["disk"] if under_disk else [])]
    meminfo(procfs, 1_000_000, 900_000)
    assert watch.poll() == (["disk"] if under_disk else [])


def test_the_data_location_reports_its_free_space_and_must_exist(tmp_path: Path) -> None:
    assert data_free_bytes(None) is None
    assert data_free_bytes(tmp_path) == free_bytes(tmp_path)
    with pytest.raises(MachineReadError, match="no such directory"):
        data_free_bytes(tmp_path / "missing")


# ---- the inventory an agent registers -------------------------------------------------------------------------------


def test_the_inventory_carries_ports_pressure_notes_and_room(tmp_path: Path) -> None:
    fake_port(tmp_path / "sys", "mlx5_0", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    options = AgentOptions(
        name="m1",
        data_dir=tmp_path / "agent",
        gpus="",
        cpus=4,
        memory_bytes=2**30,
        ib_fabric="ib-0",
        capability_notes={"outbound_policy": "no egress proxy here"},
        data_location=tmp_path,
        sysfs=tmp_path / "sys",
        procfs=meminfo(tmp_path / "proc", 1_000_000, 10_000),
    )
    node = inventory(options)
    assert node.ports == [NetworkPort(name="mlx5_0/1", speed_gbps=200, fabric="ib-0")]
    assert node.pressure[0] == "memory"
    assert (node.capabilities, node.capability_notes) == ([], {"outbound_policy": "no egress proxy here"})
    assert node.data_free_bytes is not None and node.data_free_bytes > 0


def test_declared_ports_replace_sysfs_and_take_the_named_fabric_unless_they_name_one(tmp_path: Path) -> None:
    fake_port(tmp_path / "sys", "mlx5_0", 1, "4: ACTIVE", "200 Gb/sec (4X HDR)")
    options = AgentOptions(
        name="m1",
        data_dir=tmp_path / "agent",
        gpus="",
        rdma_ports=[parse_port("a:InfiniBand:100"), parse_port("b:InfiniBand:100:ib-1"), parse_port("c:RoCE:50")],
        ib_fabric="ib-0",
        sysfs=tmp_path / "sys",
        procfs=meminfo(tmp_path / "proc", 1_000_000, 900_000),
    )
    assert [(p.name, p.fabric) for p in inventory(options).ports] == [("a", "ib-0"), ("b", "ib-1"), ("c", None)]
    assert inventory(options).data_free_bytes is None


# ---- the agent's flags ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        (["--capability-note", "sandbox"], "--capability-note sandbox: expected KEY=VALUE"),
        (["--capability-note", "egress=none"], "--capability-note egress=none: unknown capability egress"),
        (["--rdma-port", "mlx5_0:InfiniBand"], "--rdma-port mlx5_0:InfiniBand: expected NAME:LINK:SPEED[:FABRIC]"),
        (["--data-location", "/no/such/place"], "--data-location /no/such/place: no such directory"),
    ],
    ids=[
        "note without why",
        "note of an unknown one",
        "bad port",
        "missing data location",
    ],
)
def test_a_bad_agent_flag_is_refused_before_it_connects(
    flags: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from workers.cli import run

    assert run(["agent", "--name", "m1", "--temporal", "127.0.0.1:1", *flags]) == 2
    assert error in capsys.readouterr().err


# ---- hold_lease reports pressure ------------------------------------------------------------------------------------


class Workflows:
    """What the agent's client reaches: the machine's workflow, which records updates (or refuses them)."""

    def __init__(self) -> None:
        self.updates: list[tuple[str, str, Any]] = []
        self.refuse = False
        self.answering = asyncio.Event()  # cleared: an update waits (the machine's workflow task is held up)
        self.answering.set()

    def get_workflow_handle(self, workflow_id: str) -> Workflows._Handle:
        return Workflows._Handle(self, workflow_id)

    class _Handle:
        def __init__(self, owner: Workflows, workflow_id: str) -> None:
            self._owner, self._id = owner, workflow_id

        async def execute_update(self, name: str, message: Any, result_type: Any = None) -> None:
            if self._owner.refuse:
                raise RuntimeError("control plane unreachable")
            await self._owner.answering.wait()
            self._owner.updates.append((self._id, name, message))


class ScriptedPressure(PressureWatch):
    """Answers what `now` says; while `hang` is clear, a read blocks (a stalled mount)."""

    def __init__(self) -> None:
        self.now: list[str] = []
        self.hang = threading.Event()
        self.hang.set()

    def poll(self, under: Collection[str] = ()) -> list[str]:
        self.hang.wait()
        return list(self.now)


def lease_holder(tmp_path: Path, pressure: PressureWatch) -> tuple[AgentActivities, Workflows]:
    workflows = Workflows()
    node = NodeInventory(name="n0", cpus=8, memory_bytes=2**34)
    agent = AgentActivities(
        cast(Client, workflows), node, ProcessRuntime(tmp_path / "tasks"), Preparer(tmp_path), None, pressure
    )
    return agent, workflows


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


async def test_the_lease_holder_reports_pressure_when_it_changes_and_again_after_a_refusal(tmp_path: Path) -> None:
    pressure = ScriptedPressure()
    agent, workflows = lease_holder(tmp_path, pressure)
    holding = asyncio.ensure_future(
        ActivityEnvironment().run(agent.hold_lease, LeaseInput(node="n0", renew_seconds=0.02))
    )
    await asyncio.sleep(0.2)
    assert workflows.updates == []  # no pressure, as registered
    workflows.refuse = True
    pressure.now = ["memory"]
    await asyncio.sleep(0.2)
    workflows.refuse = False
    await until(lambda: len(workflows.updates) == 1)
    pressure.now = ["memory", "disk"]
    await until(lambda: len(workflows.updates) == 2)
    pressure.now = []
    await until(lambda: len(workflows.updates) == 3)
    await asyncio.sleep(0.2)
    holding.cancel()
    with suppress(BaseException):
        await holding
    assert workflows.updates == [
        ("node/n0", "report_pressure", PressureReported(pressure=p)) for p in (["memory"], ["memory", "disk"], [])
    ]


async def test_a_hung_pressure_read_never_stops_the_heartbeats(tmp_path: Path) -> None:
    pressure = ScriptedPressure()
    pressure.hang.clear()
    pressure.now = ["disk"]
    agent, workflows = lease_holder(tmp_path, pressure)
    beats: list[float] = []
    environment = ActivityEnvironment()
    environment.on_heartbeat = lambda *_: beats.append(time.monotonic())
    holding = asyncio.ensure_future(environment.run(agent.hold_lease, LeaseInput(node="n0", renew_seconds=0.05)))
    await asyncio.sleep(3)
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    assert len(beats) >= 20 and max(gaps) < 1.2  # one look waits for its read at most 1 s; later looks do not
    assert workflows.updates == []
    pressure.hang.set()  # the mount answers: the read ends and is collected at a later look
    await until(lambda: len(workflows.updates) == 1)
    holding.cancel()
    with suppress(BaseException):
        await holding
    assert workflows.updates == [("node/n0", "report_pressure", PressureReported(pressure=["disk"]))]


async def test_an_update_the_machines_workflow_is_slow_to_answer_never_stops_the_heartbeats(tmp_path: Path) -> None:
    pressure = ScriptedPressure()
    pressure.now = ["memory"]
    agent, workflows = lease_holder(tmp_path, pressure)
    workflows.answering.clear()  # a burst holds up the machine's workflow task: the report waits for its answer
    beats: list[float] = []
    environment = ActivityEnvironment()
    environment.on_heartbeat = lambda *_: beats.append(time.monotonic())
    holding = asyncio.ensure_future(environment.run(agent.hold_lease, LeaseInput(node="n0", renew_seconds=0.05)))
    await asyncio.sleep(2)
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    assert len(beats) >= 20 and max(gaps) < 0.5
    assert workflows.updates == []
    workflows.answering.set()
    await until(lambda: len(workflows.updates) == 1)
    holding.cancel()
    with suppress(BaseException):
        await holding
    assert workflows.updates == [("node/n0", "report_pressure", PressureReported(pressure=["memory"]))]


async def test_the_lease_is_renewed_once_per_renewal_though_looked_after_twice(tmp_path: Path) -> None:
    agent, _ = lease_holder(tmp_path, ScriptedPressure())
    beats: list[float] = []
    environment = ActivityEnvironment()
    environment.on_heartbeat = lambda *_: beats.append(time.monotonic())
    holding = asyncio.ensure_future(environment.run(agent.hold_lease, LeaseInput(node="n0", renew_seconds=0.2)))
    await asyncio.sleep(2.1)
    holding.cancel()
    with suppress(BaseException):
        await holding
    gaps = [later - earlier for earlier, later in itertools.pairwise(beats)]
    # Looks come every 0.1 s; a renewal at every second one: about 11 in 2.1 s, not 21.
    assert 8 <= len(beats) <= 12 and min(gaps) > 0.15


async def test_a_pause_is_counted_from_the_last_renewal_not_the_last_look(tmp_path: Path) -> None:
    """Renewals every 2 s (a TTL of 6 s), looks every 1 s. The loop is stopped 5.5 s just after a look that did not
    renew: 5.5 s unlooked, but 6.5 s unrenewed, past the TTL: the server let the lease expire, and so does the
    agent, before it acts on anything it saw before the pause."""
    agent, _ = lease_holder(tmp_path, ScriptedPressure())
    environment = ActivityEnvironment()
    paused: list[float] = []

    def pause_after_the_next_look(*_: Any) -> None:
        if not paused:
            paused.append(time.monotonic())
            asyncio.get_running_loop().call_later(1.1, time.sleep, 5.5)  # the whole agent stops, as on SIGSTOP

    environment.on_heartbeat = pause_after_the_next_look
    async with asyncio.timeout(15):
        await environment.run(agent.hold_lease, LeaseInput(node="n0", renew_seconds=2.0))
    assert agent.lost.is_set() and agent.lost_why == EXPIRED
    assert time.monotonic() - paused[0] >= 6.6
