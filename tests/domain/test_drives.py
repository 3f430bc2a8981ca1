"""The catalogue of drives, pure: what a drive's source may be, a new drive, a machine's fill reports, removal."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workflows.domain.constraints import Drive
from workflows.domain.drives import SOURCE_NEEDS, DriveReport, NewDrive, in_use_refusal, reported, source_path


@pytest.mark.parametrize(
    ("source", "path"),
    [
        pytest.param("/srv/imagenet", "/srv/imagenet", id="a path"),
        pytest.param("file:///srv/image%20net", "/srv/image net", id="a file URL"),
        pytest.param("file://localhost/srv/x", "/srv/x", id="a file URL of this host"),
    ],
)
def test_a_source_is_a_directory_the_machines_read(source: str, path: str) -> None:
    assert source_path(source) == path


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("https://example.com/imagenet.tar", id="over http"),
        pytest.param("s3://bucket/imagenet", id="an object store"),
        pytest.param("file://other-host/srv/x", id="another host"),
        pytest.param("srv/x", id="relative"),
        pytest.param("/srv/../etc", id="not normal"),
        pytest.param("/", id="the root"),
    ],
)
def test_any_other_source_is_refused_saying_what_it_needs(source: str) -> None:
    with pytest.raises(ValueError) as caught:
        source_path(source)
    assert str(caught.value) == f"source {source}: expected {SOURCE_NEEDS}"


def test_a_new_drive_is_a_drive_held_on_its_machine_in_its_site() -> None:
    new = NewDrive(name="imagenet", site="paris", machine="m1", size_bytes=2**30, source="/srv/imagenet")
    assert new.drive() == Drive(name="imagenet", size_bytes=2**30, node="m1", site="paris", source="/srv/imagenet")
    with pytest.raises(ValidationError, match="source s3://b/x: expected"):
        NewDrive(name="imagenet", site="paris", machine="m1", size_bytes=1, source="s3://b/x")
    with pytest.raises(ValidationError, match="String should match pattern"):
        NewDrive(name="ImageNet", site="paris", machine="m1", size_bytes=1, source="/srv/x")


def test_a_failed_fill_is_the_drives_problem_until_a_fill_works() -> None:
    drive = Drive(name="d", node="m1", site="paris", source="/srv/d")
    broken = reported(drive, DriveReport(drive="d", node="m2", problem="its source /srv/d is missing"))
    assert broken.problem == "its source /srv/d is missing (on m2)"
    assert reported(broken, DriveReport(drive="d", node="m3")).problem is None


def test_a_drive_in_use_names_the_runs_that_use_it() -> None:
    assert in_use_refusal("d", ["default/a"]) == "drive d is in use by default/a: stop or delete them first"
    runs = [f"default/r{i}" for i in range(7)]
    assert in_use_refusal("d", runs) == (
        "drive d is in use by default/r0, default/r1, default/r2, default/r3, default/r4 and 2 more: "
        "stop or delete them first"
    )
