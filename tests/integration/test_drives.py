"""Placed drives end to end on a real cluster (the dev server, a control plane, a scheduler and agents as
processes, workers as local processes): the catalogue (`astraeus drive create|ls|rm`), a machine's data location
chosen by an admin (`astraeus nodes data-location`), every drive reason of the spec read back as a user reads it,
a copy filled before its worker starts and reused by the next, and a drive in use that is not removed.

m1 holds the drives' data (site paris), m2 is in paris too and copies them, m3 is in lyon."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import Cluster, pairs
from workflows.domain.scheduling.machines import size_text

pytestmark = pytest.mark.integration

GIB = 2**30
MACHINE = ["--cpus", "4", "--memory-bytes", str(4 * GIB)]
READ_DRIVE = ["sh", "-c", 'cat "$ASTRAEUS_DRIVE_DATA/labels.txt"']


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("drives")
    (root / "imagenet").mkdir()
    (root / "imagenet" / "labels.txt").write_text("cat\ndog\n")
    (root / "m2-data").mkdir()
    c = Cluster(root)
    try:
        c.start(
            {
                "m1": [*MACHINE, "--site", "paris"],
                "m2": [*MACHINE, "--site", "paris"],
                "m3": [*MACHINE, "--site", "lyon"],
            }
        )
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, drive: str, machine: str, command: list[str]) -> None:
    group = {"name": "w", "cpu": 0.5, "command": command, "restart_policy": "Never"}
    group["drives"] = [{"name": "data", "drive": drive, "mount_path": "/data"}]
    spec = {"name": name, "groups": [group], "node_selection": {"names": [machine]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def reasons_on(cluster: Cluster, run: str, machine: str) -> list[str]:
    """The machine's reasons once the run explains its wait."""
    described = cluster.wait_for(lambda: (d := cluster.describe(run))["placement"]["nodes"] and d, f"{run} to wait")
    return next(n["reasons"] for n in described["placement"]["nodes"] if n["name"] == machine)  # type: ignore[no-any-return]


def worker_history(described: dict[str, Any]) -> list[tuple[str, str]]:
    [task] = described["tasks"]
    return pairs(task["history"])


def node(cluster: Cluster, name: str) -> dict[str, Any]:
    return next(n for n in cluster.json("nodes") if n["name"] == name)  # type: ignore[no-any-return]


def imagenet(cluster: Cluster) -> str:
    """The drive `imagenet` (held on m1, in paris), made once for the module's tests: its source."""
    source = str(cluster.root / "imagenet")
    if "imagenet" not in [d["name"] for d in cluster.json("drive", "ls")]:
        cluster.cli("drive", "create", "imagenet", "--site", "paris", "--machine", "m1", "--size", "1MiB",
                    "--source", source)  # fmt: skip
    return source


def test_the_catalogue_keeps_drives_and_refuses_a_source_it_cannot_copy(cluster: Cluster) -> None:
    source = str(cluster.root / "imagenet")
    made = cluster.cli("drive", "create", "labels", "--site", "paris", "--machine", "m1", "--size", "2KiB",
                       "--source", f"file://{source}")  # fmt: skip
    row = next(line.split() for line in made.stdout.splitlines() if line.startswith("labels "))
    assert row == ["labels", "paris", "m1", "2", "KiB", f"file://{source}", "-"]
    imagenet(cluster)
    listed = next(d for d in cluster.json("drive", "ls") if d["name"] == "imagenet")
    assert listed == {"name": "imagenet", "size_bytes": 2**20, "node": "m1", "site": "paris", "problem": None,
                      "source": source}  # fmt: skip
    again = cluster.cli("drive", "create", "imagenet", "--site", "paris", "--machine", "m1", "--size", "1MiB",
                        "--source", source, check=False)  # fmt: skip
    assert again.returncode != 0
    assert "drive imagenet exists: remove it first (astraeus drive rm imagenet)" in again.stderr
    cluster.cli("drive", "rm", "labels")
    remote = cluster.cli("drive", "create", "web", "--site", "paris", "--machine", "m1", "--size", "1MiB",
                         "--source", "https://example.com/web.tar", check=False)  # fmt: skip
    assert remote.returncode != 0
    assert (
        "source https://example.com/web.tar: expected a directory the machines of its site can read: an absolute "
        "path or a file:// URL (copying over a network needs a transfer service, which Astraeus does not have)"
    ) in remote.stderr


def test_a_drive_that_does_not_exist_keeps_the_worker_off_every_machine(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "missing", "nope", "m2", ["true"])
    assert reasons_on(cluster, "missing", "m2") == ["drive nope does not exist"]
    cluster.cli("cancel", "missing")


def test_a_drive_of_another_site_is_not_copied(cluster: Cluster, tmp_path: Path) -> None:
    imagenet(cluster)
    submit(cluster, tmp_path, "far", "imagenet", "m3", ["true"])
    assert reasons_on(cluster, "far", "m3") == ["drive imagenet is on m1, in another site (paris)"]
    cluster.cli("cancel", "far")


def test_a_machine_with_no_data_location_asks_for_one_then_fills_a_copy_and_reuses_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    imagenet(cluster)
    submit(cluster, tmp_path, "first", "imagenet", "m2", READ_DRIVE)
    described = cluster.wait_for(
        lambda: (d := cluster.describe("first"))["status"]["reason"] == "Choose where to keep data on m2" and d,
        "the run to ask for a data location",
    )
    assert described["status"]["state"] == "Pending"
    assert reasons_on(cluster, "first", "m2") == ["Choose where to keep data on m2"]

    data = str(cluster.root / "m2-data")
    chosen = cluster.cli("nodes", "data-location", "m2", data)
    assert chosen.stdout.splitlines()[0].startswith(f"m2: data location {data}, ")

    done = cluster.wait_state("first", "Completed", "Failed", timeout=90)
    assert done["status"]["reason"] == "All workers completed"
    assert ("Preparing", "Waiting for drive imagenet to be filled on m2") in worker_history(done)
    assert cluster.cli("logs", "first/w-0").stdout == "cat\ndog\n"

    copies = cluster.wait_for(lambda: node(cluster, "m2")["inventory"]["drive_copies"], "m2 to report its copy")
    assert [(c["drive"], c["path"], c["size_bytes"]) for c in copies] == [
        ("imagenet", f"{data}/astraeus-drives/imagenet", 8)
    ]
    shown = cluster.cli("nodes", "data-location", "m2").stdout.splitlines()
    assert shown[1].split() == ["DRIVE", "SIZE", "FILLED", "PATH"]
    assert shown[2].split()[:3] == ["imagenet", "8", "B"] and shown[2].split()[-1] == f"{data}/astraeus-drives/imagenet"

    submit(cluster, tmp_path, "second", "imagenet", "m2", READ_DRIVE)
    again = cluster.wait_state("second", "Completed", "Failed", timeout=90)
    assert again["status"]["reason"] == "All workers completed"
    waits = [r for s, r in worker_history(again) if s == "Preparing" and r.startswith("Waiting")]
    assert waits == []  # the copy was there: no wait, no second fill
    assert cluster.cli("logs", "second/w-0").stdout == "cat\ndog\n"
    assert node(cluster, "m2")["inventory"]["drive_copies"] == copies  # filled once


def test_a_data_location_the_machine_lacks_is_refused(cluster: Cluster) -> None:
    refused = cluster.cli("nodes", "data-location", "m3", "/no/such/place", check=False)
    assert refused.returncode != 0
    assert "data location /no/such/place: no such directory on machine m3" in refused.stderr
    assert node(cluster, "m3")["inventory"]["data_location"] is None


def test_a_drive_larger_than_the_room_left_is_not_copied(cluster: Cluster, tmp_path: Path) -> None:
    cluster.cli("drive", "create", "huge", "--site", "paris", "--machine", "m1", "--size", "512TiB",
                "--source", str(cluster.root / "imagenet"))  # fmt: skip
    cluster.cli("nodes", "data-location", "m2", str(cluster.root / "m2-data"))
    submit(cluster, tmp_path, "huge", "huge", "m2", ["true"])
    [reason] = reasons_on(cluster, "huge", "m2")
    free = size_text(node(cluster, "m2")["inventory"]["data_free_bytes"])
    assert reason == f"drive huge needs 512 TiB at this machine's data location, {free} free"
    cluster.cli("cancel", "huge")


def test_a_fill_that_fails_waits_and_becomes_the_drives_problem(cluster: Cluster, tmp_path: Path) -> None:
    gone = cluster.root / "gone"
    cluster.cli("drive", "create", "broken", "--site", "paris", "--machine", "m1", "--size", "1MiB",
                "--source", f"file://{gone}")  # fmt: skip
    cluster.cli("nodes", "data-location", "m2", str(cluster.root / "m2-data"))
    submit(cluster, tmp_path, "waits", "broken", "m2", ["true"])
    why = f"its source {gone} is not a directory this machine can read"
    cluster.wait_for(
        lambda: ("Preparing", f"Waiting for data volume broken: {why}") in worker_history(cluster.describe("waits")),
        "the worker to wait for its drive",
    )
    problem = cluster.wait_for(
        lambda: next(d for d in cluster.json("drive", "ls") if d["name"] == "broken")["problem"], "the problem"
    )
    assert problem == f"{why} (on m2)"
    submit(cluster, tmp_path, "after", "broken", "m2", ["true"])
    assert reasons_on(cluster, "after", "m2") == [f"drive broken: {why} (on m2)"]
    for run in ("waits", "after"):
        cluster.cli("cancel", run)


def test_a_drive_in_use_is_not_removed(cluster: Cluster, tmp_path: Path) -> None:
    imagenet(cluster)
    cluster.cli("nodes", "data-location", "m2", str(cluster.root / "m2-data"))
    submit(cluster, tmp_path, "holder", "imagenet", "m2", ["sleep", "600"])
    cluster.wait_state("holder", "Running", timeout=90)
    refused = cluster.cli("drive", "rm", "imagenet", check=False)
    assert refused.returncode != 0
    assert "drive imagenet is in use by default/holder: stop or delete them first" in refused.stderr
    assert "imagenet" in [d["name"] for d in cluster.json("drive", "ls")]

    cluster.cli("cancel", "holder")
    cluster.wait_state("holder", "Cancelled", "Failed", "Completed")
    removed = cluster.wait_for(
        lambda: (r := cluster.cli("drive", "rm", "imagenet", check=False)).returncode == 0 and r, "the drive to go"
    )
    assert "imagenet" not in [line.split()[0] for line in removed.stdout.splitlines()]
    unknown = cluster.cli("drive", "rm", "imagenet", check=False)
    assert unknown.returncode != 0 and "no drive named imagenet" in unknown.stderr


def test_an_agent_started_again_takes_up_the_data_location_chosen_and_its_copies(cluster: Cluster) -> None:
    imagenet(cluster)
    data = str(cluster.root / "m2-data")
    cluster.cli("nodes", "data-location", "m2", data)
    cluster.kill("m2")
    cluster.spawn_agent("m2", *MACHINE, "--site", "paris")  # without --data-location: the admin's choice holds
    back = cluster.wait_for(
        lambda: (n := node(cluster, "m2"))["inventory"]["data_location"] == data and n["state"] == "Ready" and n,
        "m2 to come back with its data location",
    )
    assert back["data_location"] == data
    filled = sorted(mark.stem for mark in (Path(data) / "astraeus-drives").glob("*.filled"))
    assert [c["drive"] for c in back["inventory"]["drive_copies"]] == filled


# ---- the README's walk-through -----------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def readme_commands(after: str) -> list[str]:
    """The commands of the README's first `sh` block after the line `after`, without their comments."""
    block = (ROOT / "README.md").read_text().split(after, 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def test_the_readmes_drive_commands_run_as_written(tmp_path_factory: pytest.TempPathFactory) -> None:
    """On machines named as `astraeus dev --nodes 2` names them, in a shell pointed at the cluster by
    $ASTRAEUS_TEMPORAL, each command as the README writes it."""
    commands = readme_commands("## Drives")
    assert commands[1:] == [
        "astraeus drive create imagenet --machine local-0 --size 1MiB --source /tmp/imagenet",
        "astraeus drive ls",
        "astraeus nodes data-location local-1 /tmp/astraeus-data",
        "astraeus submit examples/drive.yaml --wait",
        "astraeus logs drive/reader-0",
        "astraeus nodes data-location local-1",
        "astraeus drive rm imagenet",
    ]
    made = [p for p in (Path("/tmp/imagenet"), Path("/tmp/astraeus-data")) if not p.exists()]
    c = Cluster(tmp_path_factory.mktemp("readme-drives"))
    try:
        c.start({"local-0": MACHINE, "local-1": MACHINE})
        env = {**os.environ, "ASTRAEUS_TEMPORAL": c.address, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
        ran = [
            subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
            for command in commands
        ]
        assert [r.returncode for r in ran] == [0] * len(commands), [r.stderr for r in ran]
        assert ran[2].stdout.splitlines()[1].split()[:3] == ["imagenet", "-", "local-0"]
        assert ran[4].stdout.endswith("Completed: All workers completed\n")
        assert ran[5].stdout == "cat\ndog\n"
        shown = ran[6].stdout.splitlines()
        assert shown[0].startswith("local-1: data location /tmp/astraeus-data, ")
        assert (
            shown[2].split()[0] == "imagenet" and shown[2].split()[-1] == "/tmp/astraeus-data/astraeus-drives/imagenet"
        )
        assert (
            ran[7].stdout
            == "no drives: astraeus drive create NAME --machine MACHINE --size SIZE --source DIR [--site SITE]\n"
        )
        history = pairs(c.describe("drive")["tasks"][0]["history"])
        assert ("Preparing", "Waiting for drive imagenet to be filled on local-1") in history
    finally:
        c.stop()
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
