"""The attempts a machine holds, one record each, and the admission of GPUs and ports as pure functions of them.

An agent remembers every attempt it picks up, sets up, starts, watches, stops or returns in one `Attempt` here, kept
by its `TaskRef`, never in one set per question. The agent's shell carries out I/O (the runtime, Temporal) and tells
the record what happened; what it may give an attempt (its GPUs, its ports) is decided here from the record and from
what the runtime says its running attempts hold. No I/O, no clock: times are passed in.

An attempt's phase, in order (a start repeated for an attempt already further on finds it there):

    picked up -> setting up -> ready -> starting -> running -> returned
                     \\____________\\__________\\_> let go (refused, failed to set up, or stopped before it started)

What an attempt holds before the runtime does (its GPUs and ports) is held here while it is setting up, ready or
starting; once its start ended the runtime holds them (it says so in `gpus_in_use` and `ports_in_use`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from workflows.domain.group_parts import ExternalAccess
from workflows.domain.inventory import GpuInfo, PortRange
from workflows.domain.refs import TaskRef


class Phase(StrEnum):
    PICKED_UP = "picked up"  # an activity of this agent took it; nothing is held for it yet
    SETTING_UP = "setting up"  # admitted: its GPUs held while it is prepared and its image pulled
    READY = "ready"  # set up, its image there, not started (a gang member at the barrier)
    STARTING = "starting"  # handed to the runtime: what it holds stays held until the runtime's start ends
    RUNNING = "running"  # the runtime started it (or an activity watches it): what it holds is the runtime's
    RETURNED = "returned"  # its exit was returned to its run
    LET_GO = "let go"  # refused, failed to set up, or stopped before it started: it holds nothing


HOLDING = (Phase.SETTING_UP, Phase.READY, Phase.STARTING)  # the phases in which this record holds its GPUs and ports


@dataclass(frozen=True)
class PortMapping:
    """One external access of an attempt: the worker listens on `port` (in its container), people reach it at
    `host_port` of its machine (assigned by the agent from its --external-ports range)."""

    name: str
    port: int
    host_port: int

    @property
    def variable(self) -> str:
        return self.name.upper().replace("-", "_")


@dataclass(frozen=True)
class Attempt:
    """All this machine's agent knows of one attempt."""

    ref: TaskRef
    phase: Phase = Phase.PICKED_UP
    gpus: tuple[int, ...] = ()  # held while HOLDING
    ports: tuple[PortMapping, ...] | None = None  # its external ports, held while HOLDING; None: none assigned yet
    doing: str | None = None  # what the runtime does for it now ("starting", "Pulling <image>"), for heartbeats
    stop_asked: bool = False  # a stop came: its setup ends at its next step, and it is never started
    picked_up_at: datetime | None = None  # an activity is setting it up, since then
    told_setting_up: bool = False  # ... and its run was told something of that setup already
    activities: int = 0  # activities of this agent starting or watching it now: its run has it
    ours: bool = False  # this agent started or watched it: stopped when the lease is lost
    unwatched: bool = False  # its watch ended before it did: its end may be told to its run at a later look
    returned_at: float | None = None  # when its exit was returned to its run (seconds of the caller's clock)
    held_said: bool = False  # its runtime could not write a record of it (a full disk), and the agent's log said so

    @property
    def holding(self) -> bool:
        return self.phase in HOLDING

    @property
    def pulled(self) -> bool:
        """Its image is ready, and a repeated setup need not pull it again."""
        return self.phase in (Phase.READY, Phase.STARTING)


class Attempts:
    """Every attempt this machine's agent holds, by its `TaskRef`. Each change replaces one record whole."""

    def __init__(self) -> None:
        self._by_ref: dict[TaskRef, Attempt] = {}

    def get(self, ref: TaskRef) -> Attempt | None:
        return self._by_ref.get(ref)

    def __iter__(self) -> Iterator[Attempt]:
        return iter(sorted(self._by_ref.values(), key=lambda a: a.ref.slug))

    def _change(self, ref: TaskRef, **changes: object) -> Attempt:
        attempt = dataclasses.replace(self._by_ref.get(ref) or Attempt(ref=ref), **changes)  # type: ignore[arg-type]
        self._by_ref[ref] = attempt
        return attempt

    # ---- an activity sets it up ------------------------------------------------------------------------------

    def picked_up(self, ref: TaskRef, at: datetime) -> None:
        """An activity begins to set it up (or to start it again, further on)."""
        self._change(ref, picked_up_at=at, told_setting_up=False)

    def told_setting_up(self, ref: TaskRef) -> None:
        self._change(ref, told_setting_up=True)

    def setup_over(self, ref: TaskRef) -> None:
        """The activity setting it up returned (or failed)."""
        self._change(ref, picked_up_at=None, told_setting_up=False)

    def admitted(self, ref: TaskRef, gpus: Sequence[int]) -> None:
        self._change(ref, phase=Phase.SETTING_UP, gpus=tuple(gpus))

    def ports_assigned(self, ref: TaskRef, ports: Sequence[PortMapping]) -> None:
        self._change(ref, ports=tuple(ports))

    def pulled(self, ref: TaskRef) -> None:
        self._change(ref, phase=Phase.READY)

    def handed_to_runtime(self, ref: TaskRef) -> None:
        self._change(ref, phase=Phase.STARTING, doing="starting")

    def doing(self, ref: TaskRef, what: str | None) -> None:
        self._change(ref, doing=what)

    def start_ended(self, ref: TaskRef, started: bool) -> None:
        """The runtime's start ended: what the attempt held is the runtime's now (or nobody's)."""
        self._change(ref, phase=Phase.RUNNING if started else Phase.LET_GO, gpus=(), ports=None, doing=None)

    def let_go(self, ref: TaskRef) -> None:
        """Its setup ended short of a start (refused, failed, stopped): what it held goes back. A start already
        handed to the runtime keeps its holds until it ends (`start_ended`)."""
        attempt = self._by_ref.get(ref)
        if attempt is not None and attempt.holding and attempt.phase is not Phase.STARTING:
            self._change(ref, phase=Phase.LET_GO, gpus=(), ports=None)

    def stop_asked(self, ref: TaskRef) -> None:
        self._change(ref, stop_asked=True)

    # ---- activities that start or watch it --------------------------------------------------------------------

    def activity_began(self, ref: TaskRef) -> None:
        attempt = self._change(ref)
        self._change(ref, activities=attempt.activities + 1)

    def activity_ended(self, ref: TaskRef) -> None:
        attempt = self._change(ref)
        self._change(ref, activities=max(0, attempt.activities - 1))

    def ours(self, ref: TaskRef) -> None:
        """This agent starts it: should the lease be lost, it stops it."""
        self._change(ref, ours=True)

    def watch_began(self, ref: TaskRef) -> None:
        """A watch of it began: its end is that watch's to report."""
        attempt = self._change(ref, ours=True, unwatched=False)
        if attempt.phase not in HOLDING:
            self._change(ref, phase=Phase.RUNNING)

    def unwatched(self, ref: TaskRef) -> None:
        """Its watch ended before it did, or returned an exit that may reach no one: told at a later look."""
        self._change(ref, unwatched=True)

    def held_first_seen(self, ref: TaskRef) -> bool:
        """Its runtime holds a record of it that cannot be written: True the first time (the agent's log says why
        once per attempt, not at every look)."""
        attempt = self._change(ref)
        if attempt.held_said:
            return False
        self._change(ref, held_said=True)
        return True

    def told(self, ref: TaskRef) -> None:
        """Its end was told to its run at a look (or there is nothing to tell)."""
        self._change(ref, unwatched=False)

    def returned(self, ref: TaskRef, at: float, keep_seconds: float) -> None:
        """Its watch returned its exit to its run at `at`. Returns older than `keep_seconds` are forgotten, and so
        is the attempt that made one, unless an activity or a later look still has it: it ended long ago."""
        for other in list(self._by_ref.values()):
            if other.returned_at is not None and at - other.returned_at >= keep_seconds:
                if other.activities or other.unwatched:
                    self._change(other.ref, returned_at=None)
                else:
                    del self._by_ref[other.ref]
        self._change(ref, phase=Phase.RETURNED, returned_at=at)

    def registered_again(self, now: float, keep_seconds: float) -> None:
        """The lease had expired and is held again: an exit returned within `keep_seconds` may never have reached
        its run (its activity had timed out, or the run had given up on it), so it is told again at a look."""
        for attempt in list(self._by_ref.values()):
            if attempt.returned_at is not None:
                recent = now - attempt.returned_at < keep_seconds
                self._change(attempt.ref, returned_at=None, unwatched=attempt.unwatched or recent)

    def forget(self, ref: TaskRef) -> None:
        """Its run was deleted and its files removed: nothing of it is kept."""
        self._by_ref.pop(ref, None)

    # ---- questions ----------------------------------------------------------------------------------------------

    def gpus_held(self) -> dict[str, tuple[int, ...]]:
        """The GPUs held for attempts not yet started, by slug (a setup that holds none is there with none)."""
        return {a.ref.slug: a.gpus for a in self._by_ref.values() if a.holding}

    def ports_held(self) -> dict[str, tuple[PortMapping, ...]]:
        """The ports held for attempts not yet started, by slug."""
        return {a.ref.slug: a.ports for a in self._by_ref.values() if a.holding and a.ports is not None}

    def watched(self, ref: TaskRef) -> bool:
        """Whether an activity of this agent starts or watches it now (its run has it: no look needed)."""
        attempt = self._by_ref.get(ref)
        return attempt is not None and attempt.activities > 0

    def starting(self, ref: TaskRef) -> bool:
        attempt = self._by_ref.get(ref)
        return attempt is not None and attempt.phase is Phase.STARTING

    def stopping(self, ref: TaskRef) -> bool:
        attempt = self._by_ref.get(ref)
        return attempt is not None and attempt.stop_asked

    def ours_all(self) -> list[TaskRef]:
        return [a.ref for a in self if a.ours]

    def unwatched_all(self) -> list[TaskRef]:
        return [a.ref for a in self if a.unwatched]


# ---- admission ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    gpus: list[int]
    started: bool  # the runtime holds it already (a repeated start): nothing to set up


@dataclass(frozen=True)
class Refused:
    error: str  # for "Container start failed: <error>"


def admit_gpus(
    ref: TaskRef,
    count: int,
    gpus: Sequence[GpuInfo],
    running: Mapping[str, Sequence[int]],
    held_before: Mapping[str, Sequence[int]],
    held_now: Mapping[str, Sequence[int]],
) -> Admitted | Refused:
    """The GPUs of an attempt: those the runtime says it runs with (`running`, by slug), those held for it already,
    or `count` free, unfaulted GPUs, healthy ones first. Taken are the GPUs of every running attempt and every
    attempt held before the runtime was asked and since (`held_before`, `held_now`): a start that ended while the
    runtime was asked gave its hold back and may have been read as not running yet; read only after, it would be in
    neither, and its GPUs would go to a second attempt."""
    if ref.slug in running:
        return Admitted(gpus=list(running[ref.slug]), started=True)
    if ref.slug in held_now:
        return Admitted(gpus=list(held_now[ref.slug]), started=False)
    taken = {index for held in (running, held_before, held_now) for indices in held.values() for index in indices}
    usable = [gpu for gpu in gpus if gpu.index not in taken and gpu.fault is None]
    usable.sort(key=lambda gpu: (gpu.at_risk is not None, gpu.index))
    if count > len(usable):
        return Refused(error=f"needs {count} GPUs, {len(usable)} free on this machine")
    return Admitted(gpus=sorted(gpu.index for gpu in usable[:count]), started=False)


def assign_ports(
    access: Sequence[ExternalAccess],
    port_range: PortRange | None,
    running: Mapping[str, Mapping[str, int]],
    held_before: Mapping[str, Sequence[PortMapping]],
    held_now: Mapping[str, Sequence[PortMapping]],
    bindable: Callable[[int], bool],
) -> list[PortMapping] | Refused | None:
    """The machine's ports for an attempt's external access: from the range, in order, held by no attempt that runs
    or is held (before the runtime was asked and since, as for GPUs), and free on the machine now (`bindable`, asked
    of the lowest candidates only); None while not enough are (it waits)."""
    if port_range is None:
        return Refused(error="external_access needs ports, and this machine's agent has no --external-ports range")
    taken = {port for ports in running.values() for port in ports.values()}
    taken |= {m.host_port for held in (held_before, held_now) for mappings in held.values() for m in mappings}
    free: list[int] = []
    for port in range(port_range.first, port_range.last + 1):
        if len(free) == len(access):
            break
        if port not in taken and bindable(port):
            free.append(port)
    if len(free) < len(access):
        return None
    return [PortMapping(a.name, a.port, p) for a, p in zip(access, free, strict=True)]
