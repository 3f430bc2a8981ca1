"""What the agent reads of its machine besides GPUs: RDMA ports (sysfs), pressure (/proc/meminfo and statvfs) and
the free space at its data location. The roots are arguments (as node_exporter's --path.sysfs), so an agent in a
container reads the host's, and tests read fake trees."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import Literal

from workflows.domain.inventory import NetworkPort

log = logging.getLogger(__name__)

SYSFS = Path("/sys")
PROCFS = Path("/proc")
PRESSURE_FRACTION = 0.05  # below this share of memory available, or of disk free, the machine takes no new work
PRESSURE_CLEAR_FRACTION = 0.07  # and one under pressure takes it again only above this share: no flapping at 5%

Link = Literal["InfiniBand", "Ethernet"]
_LINKS: dict[str, Link] = {"infiniband": "InfiniBand", "ib": "InfiniBand", "ethernet": "Ethernet", "roce": "Ethernet"}


class MachineReadError(ValueError):
    """A declaration the agent cannot use (a bad --rdma-port, a data location that does not exist)."""


# ---- RDMA ports ---------------------------------------------------------------------------------------------------


def read_rdma_ports(sysfs: Path = SYSFS, ib_fabric: str | None = None) -> list[NetworkPort]:
    """Every port of every RDMA device under <sysfs>/class/infiniband, named `<device>/<port>`. An InfiniBand
    port's fabric is `ib_fabric` when given, else its subnet prefix (the first four groups of GID 0). A machine
    without the directory has none; a port whose files cannot be read is left out, with a warning."""
    root = sysfs / "class" / "infiniband"
    if not root.is_dir():
        return []
    ports: list[NetworkPort] = []
    for device in sorted(root.iterdir(), key=lambda p: p.name):
        port_dir = device / "ports"
        if not port_dir.is_dir():
            continue
        for port in sorted(port_dir.iterdir(), key=lambda p: (len(p.name), p.name)):
            try:
                ports.append(_read_port(f"{device.name}/{port.name}", port, ib_fabric))
            except (OSError, MachineReadError) as err:
                log.warning("RDMA port %s/%s left out: %s", device.name, port.name, err)
    return ports


def _read_port(name: str, port: Path, ib_fabric: str | None) -> NetworkPort:
    link = _link((port / "link_layer").read_text().strip())
    fabric = None
    if link == "InfiniBand":
        fabric = ib_fabric or subnet_prefix((port / "gids" / "0").read_text())
    return NetworkPort(
        name=name,
        link=link,
        active=port_active((port / "state").read_text()),
        speed_gbps=rate_gbps((port / "rate").read_text()),
        fabric=fabric,
    )


def port_active(state: str) -> bool:
    """sysfs `state`: "4: ACTIVE" is active; DOWN, INIT, ARMED are not."""
    return state.strip().partition(":")[2].strip().upper() == "ACTIVE"


def rate_gbps(rate: str) -> int:
    """sysfs `rate`: "200 Gb/sec (4X HDR)" -> 200; a fraction is rounded down ("2.5 Gb/sec" -> 2)."""
    match = re.match(r"\s*(\d+(?:\.\d+)?)\s*Gb/sec", rate)
    if match is None:
        raise MachineReadError(f"unreadable rate {rate.strip()!r}")
    return int(float(match.group(1)))


def subnet_prefix(gid: str) -> str:
    """The subnet prefix of an InfiniBand GID: its first four groups ("fe80:0000:0000:0000")."""
    groups = gid.strip().split(":")
    if len(groups) != 8:
        raise MachineReadError(f"unreadable GID {gid.strip()!r}")
    return ":".join(groups[:4])


def _link(text: str) -> Link:
    link = _LINKS.get(text.lower())
    if link is None:
        raise MachineReadError(f"unknown link layer {text!r} (expected InfiniBand or Ethernet)")
    return link


def parse_port(declared: str) -> NetworkPort:
    """`--rdma-port NAME:LINK:SPEED[:FABRIC]`, e.g. `mlx5_0:InfiniBand:200:ib-0` or `mlx5_1:Ethernet:100`
    (RoCE); a declared port is active."""
    parts = declared.split(":")
    if len(parts) not in (3, 4) or not parts[0]:
        raise MachineReadError(f"--rdma-port {declared}: expected NAME:LINK:SPEED[:FABRIC], e.g. mlx5_0:InfiniBand:200")
    name, link, speed = parts[:3]
    fabric = parts[3] if len(parts) == 4 and parts[3] else None
    if not speed.isdigit():
        raise MachineReadError(f"--rdma-port {declared}: speed {speed!r} is not a whole number of Gb/s")
    try:
        kind = _link(link)
    except MachineReadError as err:
        raise MachineReadError(f"--rdma-port {declared}: {err}") from None
    if fabric is not None and kind != "InfiniBand":
        raise MachineReadError(f"--rdma-port {declared}: only an InfiniBand port is on a fabric")
    return NetworkPort(name=name, link=kind, active=True, speed_gbps=int(speed), fabric=fabric)


# ---- space and pressure ------------------------------------------------------------------------------------------


def free_bytes(path: Path) -> int:
    """What an unprivileged writer may still write on the filesystem of `path` (statvfs f_bavail)."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def data_free_bytes(location: Path | None) -> int | None:
    """The free space at the machine's data location; None when none was chosen."""
    if location is None:
        return None
    if not location.is_dir():
        raise MachineReadError(f"--data-location {location}: no such directory")
    return free_bytes(location)


def under_pressure(free: int, total: int, was: bool) -> bool:
    """Below 5% of `total` free comes under pressure; under it, stays so until above 7% free (hysteresis: a machine
    that hovers at the 5% line does not come under pressure and leave it at every look)."""
    if total <= 0:
        return False
    return free < (PRESSURE_CLEAR_FRACTION if was else PRESSURE_FRACTION) * total


def memory_pressure(procfs: Path = PROCFS, was: bool = False) -> bool:
    """MemAvailable below 5% of MemTotal (7% while under pressure). A kernel that does not report MemAvailable
    (before 3.14) shows none."""
    values: dict[str, int] = {}
    for line in (procfs / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if key in ("MemTotal", "MemAvailable") and fields and fields[0].isdigit():
            values[key] = int(fields[0])
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    if not total or available is None:
        return False
    return under_pressure(available, total, was)


def disk_pressure(path: Path, was: bool = False) -> bool:
    """The filesystem of `path` (or of its nearest existing parent: a data dir not made yet) has below 5% free (7%
    while under pressure)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stat = os.statvfs(path)
    if stat.f_blocks == 0:  # a pseudo filesystem has no size to run out of
        return False
    return under_pressure(stat.f_bavail, stat.f_blocks, was)


class PressureWatch:
    """The machine's pressure conditions as the spec names them ("memory", "disk"), read again at each poll."""

    def __init__(self, data_dir: Path, procfs: Path = PROCFS) -> None:
        self._data_dir = data_dir
        self._procfs = procfs

    def poll(self, under: Collection[str] = ()) -> list[str]:
        """The conditions now, given those the machine is `under` (as last reported: each clears only above 7%).
        Blocking (a file read, a statvfs that a hung mount can stall): call it off the event loop."""
        conditions = []
        if memory_pressure(self._procfs, "memory" in under):
            conditions.append("memory")
        if disk_pressure(self._data_dir, "disk" in under):
            conditions.append("disk")
        return conditions
