"""A machine's copies of drives (activities/agent/drives.py) and how a worker is given one
(activities/agent/prepare.py): a copy filled on a thread while the worker waits, kept and found again by a new agent, a
fill that fails or that holds more than the drive's size, a copy cut short, and the path or mount each runtime gives."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from activities.agent.drives import COPIES, DriveStore
from activities.agent.machine import MachineReadError
from activities.agent.prepare import Prepared, Preparer, Waiting
from activities.agent.runtime.base import Mount
from workflows.domain.constraints import Drive
from workflows.domain.drives import DriveReport
from workflows.domain.group_parts import DriveSpec
from workflows.domain.reasons import Reason
from workflows.domain.refs import TaskRef
from workflows.domain.spec import GroupSpec

KEY = TaskRef(namespace="default", job="run", task_id="w-0", attempt=1)


def source(tmp_path: Path, text: str = "cat\ndog\n") -> Path:
    path = tmp_path / "imagenet"
    path.mkdir()
    (path / "labels.txt").write_text(text)
    return path


def filled(store: DriveStore, drive: Drive) -> Path | Reason:
    """What copy_of answers once the fill it began has ended."""
    filling = f"Waiting for drive {drive.name} to be filled on m2"
    answer = store.copy_of(drive)
    assert isinstance(answer, Reason) and answer.text == filling
    deadline = time.monotonic() + 10
    while isinstance(answer, Reason) and answer.text == filling:
        assert time.monotonic() < deadline
        time.sleep(0.02)
        answer = store.copy_of(drive)
    return answer


def test_a_copy_is_filled_while_the_worker_waits_then_kept_and_found_again_by_a_new_agent(tmp_path: Path) -> None:
    drive = Drive(name="imagenet", size_bytes=2**20, node="m1", source=str(source(tmp_path)))
    (tmp_path / "data").mkdir()
    store = DriveStore("m2", tmp_path / "data")
    copy = filled(store, drive)
    assert copy == tmp_path / "data" / COPIES / "imagenet"
    assert (copy / "labels.txt").read_text() == "cat\ndog\n"
    assert store.take_reports() == [DriveReport(drive="imagenet", node="m2", problem=None)]
    report = store.report()
    assert (report.data_location, [(c.drive, c.size_bytes) for c in report.drive_copies]) == (
        str(tmp_path / "data"),
        [("imagenet", 8)],
    )
    again = DriveStore("m2", tmp_path / "data")  # the agent restarted: its copy is there, no second fill
    assert again.copy_of(drive) == copy
    assert again.take_reports() == []


@pytest.mark.parametrize(
    ("size", "made", "why"),
    [
        pytest.param(2**20, False, "its source {src} is not a directory this machine can read", id="no source"),
        pytest.param(4, True, "its files hold 8 B, more than its size of 4 B", id="larger than its size"),
    ],
)
def test_a_fill_that_fails_is_a_wait_and_a_problem_for_the_catalogue(
    tmp_path: Path, size: int, made: bool, why: str
) -> None:
    src = source(tmp_path) if made else tmp_path / "gone"
    drive = Drive(name="imagenet", size_bytes=size, node="m1", source=f"file://{src}")
    (tmp_path / "data").mkdir()
    store = DriveStore("m2", tmp_path / "data")
    waits = filled(store, drive)
    assert isinstance(waits, Reason)
    assert waits.text == f"Waiting for data volume imagenet: {why.format(src=src)}"
    assert store.take_reports() == [DriveReport(drive="imagenet", node="m2", problem=why.format(src=src))]
    assert list((tmp_path / "data" / COPIES).iterdir()) == []  # nothing half made is left


def test_a_copy_cut_short_is_removed_and_a_data_location_must_exist(tmp_path: Path) -> None:
    partial = tmp_path / "data" / COPIES / "imagenet"
    partial.mkdir(parents=True)  # no mark: the agent stopped while filling it
    DriveStore("m2", tmp_path / "data")
    assert not partial.exists()
    with pytest.raises(MachineReadError, match=r"^data location /no/such: no such directory on machine m2$"):
        DriveStore("m2", Path("/no/such"))


def placed(name: str = "imagenet") -> GroupSpec:
    return GroupSpec(name="w", command=["true"], drives=[DriveSpec(name="data", drive=name, mount_path="/data")])


def test_the_process_runtime_is_given_the_copys_path_and_docker_a_read_only_mount(tmp_path: Path) -> None:
    drive = Drive(name="imagenet", size_bytes=2**20, node="m1", source=str(source(tmp_path)))
    (tmp_path / "data").mkdir()
    store = DriveStore("m2", tmp_path / "data")
    copy = filled(store, drive)
    catalogue = {"imagenet": drive}
    process = Preparer(tmp_path / "agent", store=store, mounts=False).prepare(KEY, placed(), catalogue)
    assert process == Prepared(env={"ASTRAEUS_DRIVE_DATA": str(copy)})
    docker = Preparer(tmp_path / "agent", store=store).prepare(KEY, placed(), catalogue)
    mount = Mount(target="/data", source=str(copy), kind="bind", read_only=True)
    assert docker == Prepared(env={"ASTRAEUS_DRIVE_DATA": "/data"}, mounts=[mount])


def test_on_the_drives_own_machine_the_worker_reads_its_source(tmp_path: Path) -> None:
    src = source(tmp_path)
    drive = Drive(name="imagenet", size_bytes=2**20, node="m1", source=f"file://{src}")
    preparer = Preparer(tmp_path / "agent", store=DriveStore("m1"), mounts=False)
    assert preparer.prepare(KEY, placed(), {"imagenet": drive}) == Prepared(env={"ASTRAEUS_DRIVE_DATA": str(src)})


def test_a_drive_not_in_the_catalogue_or_no_data_location_is_a_wait(tmp_path: Path) -> None:
    preparer = Preparer(tmp_path / "agent", store=DriveStore("m2"))
    assert preparer.prepare(KEY, placed("nope"), {}) == Waiting(
        Reason(code="WaitingForDataVolume", text="Waiting for data volume nope: drive nope does not exist")
    )
    drive = Drive(name="imagenet", node="m1", source="/srv/imagenet")
    waits = preparer.prepare(KEY, placed(), {"imagenet": drive})
    assert isinstance(waits, Waiting)
    assert waits.reason.text == (
        "Waiting for data volume imagenet: machine m2 has no data location (astraeus nodes data-location m2 PATH)"
    )
