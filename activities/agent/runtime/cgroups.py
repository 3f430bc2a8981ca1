"""Memory cgroups for the process runtime: where this machine can make them, and making one per attempt.

The one module that knows where cgroups live (the shim, standard library only, ends them: `shim.end_cgroup`). With
cgroup v1 an attempt's cgroup is `<the agent's own memory cgroup>/astraeus/<slug>`; with v2 (the unified hierarchy)
it is `<mount>/astraeus/<slug>`, since a v2 cgroup that holds processes (the agent's own) cannot give its children
a controller. The path is kept in the attempt's directory, so an agent that restarts elsewhere finds it again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal

SUBTREE = "astraeus"  # the directory under which every attempt's cgroup is made
PROC_SELF = Path("/proc/self")


@dataclass(frozen=True)
class MemoryCgroups:
    """Attempts' memory cgroups are made under `parent`, in a hierarchy of cgroup `version` 1 or 2."""

    parent: Path
    version: Literal[1, 2]

    def create(self, slug: str, limit_bytes: int) -> Path:
        """Make the attempt's cgroup with its memory limit (swap counted in it, as the docker runtime does, so that
        exceeding it is an OOM kill rather than swapping) and return it. Raises OSError."""
        cgroup = self.parent / slug
        self._prepare_parent()
        try:
            cgroup.mkdir(exist_ok=True)
        except FileNotFoundError:  # a shim that ended removed the parent, empty, just then: make it again
            self._prepare_parent()
            cgroup.mkdir(exist_ok=True)
        if self.version == 1:
            _write(cgroup / "memory.limit_in_bytes", limit_bytes)
            if (cgroup / "memory.memsw.limit_in_bytes").exists():  # only with swap accounting on
                _write(cgroup / "memory.memsw.limit_in_bytes", limit_bytes)
        else:
            _write(cgroup / "memory.max", limit_bytes)
            if (cgroup / "memory.swap.max").exists():
                _write(cgroup / "memory.swap.max", 0)
        return cgroup

    def _prepare_parent(self) -> None:
        self.parent.mkdir(exist_ok=True)
        if self.version == 2:  # the memory controller must be given to the parent's children, and to the parent
            for directory in (self.parent.parent, self.parent):
                control = directory / "cgroup.subtree_control"
                if "memory" not in control.read_text().split():
                    _write(control, "+memory")


@dataclass(frozen=True)
class Unenforced:
    """This machine cannot make memory cgroups; `why` says so to people."""

    why: str


def find_memory_cgroups(proc_self: Path = PROC_SELF) -> MemoryCgroups | Unenforced:
    """Where this process can make memory cgroups: the v1 memory controller's hierarchy if mounted, else the v2
    hierarchy if it offers the memory controller; or why it cannot (no controller, not allowed to write)."""
    try:
        mounts = (proc_self / "mountinfo").read_text()
        own = (proc_self / "cgroup").read_text()
    except OSError as err:
        return Unenforced(f"cannot read {err.filename} ({err.strerror}): no cgroups to enforce memory_bytes with")
    v1 = _mount(mounts, "cgroup", "memory")
    if v1 is not None:
        mount_point, mount_root = v1
        base = mount_point / _within(_own_path(own, "memory"), mount_root)
        return _writable(MemoryCgroups(base / SUBTREE, 1), base)
    v2 = _mount(mounts, "cgroup2", None)
    if v2 is None:
        return Unenforced("no cgroup memory controller is mounted on this machine")
    mount_point, _ = v2
    try:
        controllers = (mount_point / "cgroup.controllers").read_text().split()
    except OSError as err:
        return Unenforced(f"cannot read {err.filename} ({err.strerror})")
    if "memory" not in controllers:
        return Unenforced(f"the cgroup v2 hierarchy at {mount_point} offers no memory controller")
    return _writable(MemoryCgroups(mount_point / SUBTREE, 2), mount_point)


def _writable(cgroups: MemoryCgroups, base: Path) -> MemoryCgroups | Unenforced:
    """`cgroups` if this process may make directories where they go, else why not."""
    where = cgroups.parent if cgroups.parent.exists() else base
    if not os.access(where, os.W_OK):
        return Unenforced(f"cannot make cgroups in {where}: the agent must run as root")
    return cgroups


def _mount(mountinfo: str, fstype: str, controller: str | None) -> tuple[Path, str] | None:
    """(mount point, root within the hierarchy) of the first mount of `fstype` with `controller` among its super
    options (v1), or of any such mount (controller None: v2). A mountinfo line: `id parent dev root point opts
    [optional fields] - fstype source super-options`."""
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) < 5 or len(tail) < 3 or tail[0] != fstype:
            continue
        if controller is None or controller in tail[2].split(","):
            return Path(_unescape(fields[4])), _unescape(fields[3])
    return None


def _own_path(proc_cgroup: str, controller: str) -> str:
    """This process's cgroup in the v1 hierarchy of `controller`, from /proc/self/cgroup (`id:controllers:path`)."""
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return path
    return "/"


def _within(path: str, mount_root: str) -> str:
    """`path` relative to the mount's root (a container may see only part of the hierarchy); "" when outside."""
    try:
        return str(PurePosixPath(path).relative_to(mount_root))
    except ValueError:
        return ""


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def _write(path: Path, value: int | str) -> None:
    path.write_text(f"{value}\n")
