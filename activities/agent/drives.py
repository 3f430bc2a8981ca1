"""A machine's copies of the catalogue's drives, at its data location: `<location>/astraeus-drives/<drive>/`.

A copy is filled on a thread of its own while the worker that needs it waits ("Waiting for drive <d> to be filled
on <machine>"), from the drive's source (a directory this machine can read: workflows/domain/drives.py). It is
copied under a temporary name, renamed into place and then marked filled (`<drive>.filled`, JSON): a copy without
its mark was cut short (the agent stopped) and is filled again. A filled copy is kept and reused by the next
workers of the machine. A fill that fails is told to the catalogue (a problem keeps new workers off the drive) and
tried again after FILL_RETRY_SECONDS."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from temporalio.client import Client
from temporalio.exceptions import ApplicationError

from activities.agent.machine import MachineReadError, free_bytes
from workflows import contracts
from workflows.contracts import DRIVES_WORKFLOW_ID, implements, node_id
from workflows.domain.constraints import Drive
from workflows.domain.drives import DriveReport, source_path
from workflows.domain.inventory import DriveCopy
from workflows.domain.machine.decisions import DataReported
from workflows.domain.reasons import R, Reason
from workflows.domain.scheduling.machines import size_text
from workflows.messages import DataLocationRequest

log = logging.getLogger(__name__)

COPIES = "astraeus-drives"
FILL_RETRY_SECONDS = 10.0  # a fill that failed is tried again after this long


class DriveStore:
    """The data location of one machine and the copies there; safe to use from several threads."""

    def __init__(self, node: str, location: Path | None = None) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._location: Path | None = None
        self._filling: dict[str, threading.Thread] = {}
        self._failed: dict[str, tuple[str, float]] = {}  # drive -> (why, when: time.monotonic())
        self._reports: list[DriveReport] = []  # fills to tell the catalogue of
        self.changed = threading.Event()  # set when the machine's workflow should hear `report()` again
        if location is not None:
            self.use(location)
            self.changed.clear()  # what it registers with says it

    @property
    def location(self) -> Path | None:
        return self._location

    def use(self, location: Path) -> None:
        """Keep copies at `location` from now on (a directory of this machine); copies cut short there are removed."""
        if not location.is_absolute() or not location.is_dir():
            raise MachineReadError(f"data location {location}: no such directory on machine {self.node}")
        root = location / COPIES
        root.mkdir(exist_ok=True)
        for entry in root.iterdir():
            if entry.is_dir() and not (root / f"{entry.name}.filled").exists():
                shutil.rmtree(entry, ignore_errors=True)  # a fill cut short, or its temporary copy
        with self._lock:
            self._location = location
            self._failed.clear()
        self.changed.set()

    def report(self) -> DataReported:
        """Where data is kept, the room left there, and the filled copies."""
        location = self._location
        if location is None:
            return DataReported(data_location=None, data_free_bytes=None)
        return DataReported(
            data_location=str(location), data_free_bytes=free_bytes(location), drive_copies=self.copies()
        )

    def copies(self) -> list[DriveCopy]:
        location = self._location
        if location is None:
            return []
        copies = []
        for mark in sorted((location / COPIES).glob("*.filled")):
            try:
                kept = json.loads(mark.read_text())
                copies.append(DriveCopy(drive=mark.stem, path=str(mark.with_suffix("")), **kept))
            except (OSError, ValueError, TypeError) as err:
                log.warning("%s: copy mark %s unreadable: %s", self.node, mark, err)
        return copies

    def take_reports(self) -> list[DriveReport]:
        with self._lock:
            reports, self._reports = self._reports, []
        return reports

    def copy_of(self, drive: Drive) -> Path | Reason:
        """The filled copy of `drive` here, or why the worker waits: its fill is under way (begun now if need be),
        or failed lately."""
        location = self._location
        if location is None:
            why = f"machine {self.node} has no data location (astraeus nodes data-location {self.node} PATH)"
            return R.WaitingForDataVolume(volume=drive.name, why=why)
        target = location / COPIES / drive.name
        if (location / COPIES / f"{drive.name}.filled").exists():
            return target
        with self._lock:
            failed = self._failed.get(drive.name)
            if failed is not None and time.monotonic() - failed[1] < FILL_RETRY_SECONDS:
                return R.WaitingForDataVolume(volume=drive.name, why=failed[0])
            if drive.name not in self._filling:
                thread = threading.Thread(
                    target=self._fill, args=(drive, target), daemon=True, name=f"fill-{drive.name}"
                )
                self._filling[drive.name] = thread
                thread.start()
        return R.WaitingForDriveFill(drive=drive.name, node=self.node)

    def _fill(self, drive: Drive, target: Path) -> None:
        problem = None
        try:
            problem = _copy(drive, target)
        except Exception as err:  # a fill never ends the agent: the worker waits, and the fill is tried again
            problem = f"its copy could not be made: {err}"
        with self._lock:
            del self._filling[drive.name]
            if problem is None:
                self._failed.pop(drive.name, None)
            else:
                log.warning("%s: drive %s: %s", self.node, drive.name, problem)
                self._failed[drive.name] = (problem, time.monotonic())
            self._reports.append(DriveReport(drive=drive.name, node=self.node, problem=problem))
        self.changed.set()


def _copy(drive: Drive, target: Path) -> str | None:
    """Copy the drive's source to `target`; None when done, else why not (the copy is then removed)."""
    source = Path(source_path(drive.source))
    if not source.is_dir():
        return f"its source {source} is not a directory this machine can read"
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        shutil.copytree(source, partial, symlinks=True)
    except (OSError, shutil.Error) as err:
        shutil.rmtree(partial, ignore_errors=True)
        return f"its source {source} could not be copied: {err}"
    size = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file() and not f.is_symlink())
    if size > drive.size_bytes:
        shutil.rmtree(partial, ignore_errors=True)
        return f"its files hold {size_text(size)}, more than its size of {size_text(drive.size_bytes)}"
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    mark = {"size_bytes": size, "filled_at": datetime.now(UTC).isoformat()}
    tmp = target.with_name(f".{target.name}.filled.tmp")
    tmp.write_text(json.dumps(mark))
    os.replace(tmp, target.with_name(f"{target.name}.filled"))
    return None


class DriveActivities:
    """The agent's side of drives: the activity `use_data_location` (an admin chose where its machine keeps data),
    the catalogue a worker's drives are read from, and the reports of its data location and fills, sent from the
    lease's loop when something changed."""

    def __init__(self, client: Client, store: DriveStore) -> None:
        self._client = client
        self.store = store

    @implements(contracts.use_data_location)
    async def use_data_location(self, input: DataLocationRequest) -> DataReported:
        try:
            await asyncio.to_thread(self.store.use, Path(input.path))
        except (MachineReadError, OSError) as err:
            raise ApplicationError(str(err), type="NoDataLocation", non_retryable=True) from None
        self.store.changed.clear()  # its workflow hears this answer
        return await asyncio.to_thread(self.store.report)

    def chosen(self, location: str | None) -> None:
        """The machine's workflow holds an admin's choice (told when the agent registers): use it."""
        if location is None or (self.store.location is not None and str(self.store.location) == location):
            return
        try:
            self.store.use(Path(location))
        except (MachineReadError, OSError) as err:
            log.warning("%s: the data location chosen for it cannot be used: %s", self.store.node, err)

    async def catalogue(self) -> Mapping[str, Drive]:
        """The cluster's drives; none when the catalogue cannot be read now (the worker waits and asks again)."""
        try:
            handle = self._client.get_workflow_handle(DRIVES_WORKFLOW_ID)
            return {d.name: d for d in await contracts.query(handle, contracts.DRIVES)}
        except Exception as err:
            log.warning("%s: the catalogue of drives is unreadable now: %s", self.store.node, err)
            return {}

    async def report(self) -> None:
        """Tell the machine's workflow its data location's room and copies, and the catalogue how fills went."""
        store = self.store
        if store.changed.is_set():
            store.changed.clear()
            try:
                report = await asyncio.to_thread(store.report)
                handle = self._client.get_workflow_handle(node_id(store.node))
                await contracts.update(handle, contracts.REPORT_DATA, report)
            except Exception as err:  # told again at the next look
                store.changed.set()
                log.warning("%s: could not report its data location: %s", store.node, err)
        for fill in store.take_reports():
            try:
                handle = self._client.get_workflow_handle(DRIVES_WORKFLOW_ID)
                await contracts.update(handle, contracts.REPORT_DRIVE, fill)
            except Exception as err:  # the catalogue learns it at the drive's next fill
                log.warning("%s: could not report the fill of drive %s: %s", store.node, fill.drive, err)
