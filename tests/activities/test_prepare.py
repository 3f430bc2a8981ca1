"""Preparing a worker on its machine: each step ready, waiting with the spec's reason, or refused for good."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from activities.agent.prepare import Prepared, Preparer, Waiting
from activities.agent.runtime.base import Mount, RegistryAuth, RuntimeFailure
from workflows.domain.reasons import Reason
from workflows.domain.refs import TaskRef
from workflows.domain.spec import GroupSpec

KEY = TaskRef(namespace="team-a", job="llm", task_id="train-0", attempt=2)


def group(**fields: Any) -> GroupSpec:
    return GroupSpec.model_validate({"name": "train", "command": ["train"], **fields})


def put_secret(data_dir: Path, name: str, key: str, value: bytes | str) -> None:
    path = data_dir / "secrets" / name / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(value.encode() if isinstance(value, str) else value)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "agent"


@pytest.fixture
def preparer(data_dir: Path) -> Preparer:
    return Preparer(data_dir)


def test_a_worker_without_drives_or_secrets_is_ready_at_once(preparer: Preparer) -> None:
    assert preparer.prepare(KEY, group()) == Prepared()


def test_a_drive_waits_until_its_host_path_exists(preparer: Preparer, tmp_path: Path) -> None:
    data = tmp_path / "datasets"
    spec = group(drives=[{"name": "data", "host_path": str(data), "mount_path": "/data", "read_only": True}])

    assert preparer.prepare(KEY, spec) == Waiting(
        reason=Reason("WaitingForDataVolume", f"Waiting for data volume data: host path {data} does not exist yet")
    )
    data.write_text("")
    waiting = preparer.prepare(KEY, spec)
    assert isinstance(waiting, Waiting)
    assert waiting.reason.text == f"Waiting for data volume data: host path {data} is not a directory"
    data.unlink()
    data.mkdir()
    assert preparer.prepare(KEY, spec) == Prepared(
        mounts=[Mount(target="/data", source=str(data), kind="bind", read_only=True)]
    )


def test_a_named_volume_is_mounted_as_it_is(preparer: Preparer) -> None:
    spec = group(drives=[{"name": "cache", "volume": "hf-cache", "mount_path": "/root/.cache"}])

    assert preparer.prepare(KEY, spec) == Prepared(
        mounts=[Mount(target="/root/.cache", source="hf-cache", kind="volume")]
    )


@pytest.mark.parametrize(
    ("host_path", "why"),
    [
        pytest.param("/etc/ssl", "is a system path or the agent's own", id="a system path"),
        pytest.param("/proc", "is a system path or the agent's own", id="the proc filesystem"),
        pytest.param("{data_dir}/secrets", "is a system path or the agent's own", id="the agent's own secrets"),
        pytest.param("{link}", "leads to /sys, refused", id="a link that leads to a system path"),
    ],
)
def test_a_host_path_the_machine_refuses_makes_the_task_invalid(
    preparer: Preparer, data_dir: Path, tmp_path: Path, host_path: str, why: str
) -> None:
    (tmp_path / "sys-link").symlink_to("/sys")
    path = host_path.format(data_dir=data_dir.resolve(), link=tmp_path / "sys-link")
    spec = group(drives=[{"name": "d", "host_path": path, "mount_path": "/d"}])

    with pytest.raises(RuntimeFailure) as failure:
        preparer.prepare(KEY, spec)

    assert failure.value.reason.code == "InvalidTask"
    assert failure.value.reason.text == f"Invalid task: drive d: host path {path} {why}"


def test_only_the_allowed_host_paths_are_mounted_when_the_machine_says_which(data_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "data" / "a").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    preparer = Preparer(data_dir, host_paths=[str(tmp_path / "data")])

    inside = group(drives=[{"name": "d", "host_path": str(tmp_path / "data" / "a"), "mount_path": "/d"}])
    outside = group(drives=[{"name": "d", "host_path": str(tmp_path / "other"), "mount_path": "/d"}])

    assert isinstance(preparer.prepare(KEY, inside), Prepared)
    with pytest.raises(RuntimeFailure) as failure:
        preparer.prepare(KEY, outside)
    assert failure.value.reason.text == (
        f"Invalid task: drive d: host path {tmp_path / 'other'} is outside the host paths this machine allows "
        f"({tmp_path / 'data'})"
    )


def test_a_secret_waits_until_it_is_synced_then_becomes_a_variable(preparer: Preparer, data_dir: Path) -> None:
    spec = group(secrets=[{"name": "hf", "key": "token", "env": "HF_TOKEN"}])

    waiting = preparer.prepare(KEY, spec)
    assert isinstance(waiting, Waiting)
    assert (waiting.reason.code, waiting.reason.text) == (
        "WaitingForExternalSecret",
        "waiting for external secret hf (key token) to be synced to this node",
    )
    put_secret(data_dir, "hf", "token", "hf_abc\n")
    assert preparer.prepare(KEY, spec) == Prepared(env={"HF_TOKEN": "hf_abc\n"})


def test_a_secret_that_is_not_text_cannot_be_a_variable(preparer: Preparer, data_dir: Path) -> None:
    put_secret(data_dir, "tls", "key", b"\x00\xff")
    with pytest.raises(RuntimeFailure) as failure:
        preparer.prepare(KEY, group(secrets=[{"name": "tls", "key": "key", "env": "TLS_KEY"}]))

    assert failure.value.reason.text == (
        "Invalid task: secret tls (key key) is not text and cannot be the variable TLS_KEY"
    )


def test_a_secret_file_is_written_for_the_attempt_and_mounted_read_only(preparer: Preparer, data_dir: Path) -> None:
    put_secret(data_dir, "db", "password", b"pa55\x00word")
    prepared = preparer.prepare(KEY, group(secrets=[{"name": "db", "key": "password", "path": "/run/secrets/db"}]))

    host_file = data_dir / "config" / KEY.slug / "0-db"
    assert prepared == Prepared(mounts=[Mount(target="/run/secrets/db", source=str(host_file), read_only=True)])
    assert host_file.read_bytes() == b"pa55\x00word"
    assert stat.S_IMODE(host_file.stat().st_mode) == 0o444
    assert stat.S_IMODE(host_file.parent.stat().st_mode) == 0o700
    assert preparer.prepare(KEY, group(secrets=[{"name": "db", "key": "password", "path": "/run/secrets/db"}]))


def test_a_config_file_that_cannot_be_written_fails_naming_its_path(preparer: Preparer, data_dir: Path) -> None:
    put_secret(data_dir, "db", "password", "x")
    (data_dir / "config").write_text("a file where a directory belongs")

    with pytest.raises(RuntimeFailure) as failure:
        preparer.prepare(KEY, group(secrets=[{"name": "db", "key": "password", "path": "/run/secrets/db"}]))

    assert (failure.value.reason.code, failure.value.reason.text) == (
        "WritingConfigFailed",
        "Writing config /run/secrets/db: Not a directory",
    )


def test_a_registry_secret_waits_for_both_its_keys(preparer: Preparer, data_dir: Path) -> None:
    spec = group(image="registry.example/team/train:1", registry_secret="regcred")
    put_secret(data_dir, "regcred", "username", "robot\n")

    waiting = preparer.prepare(KEY, spec)
    assert isinstance(waiting, Waiting)
    assert waiting.reason.text == "waiting for registry secret regcred to be synced to this node"
    put_secret(data_dir, "regcred", "password", "hunter2\n")
    prepared = preparer.prepare(KEY, spec)
    assert isinstance(prepared, Prepared)
    assert prepared.registry_auth == RegistryAuth(username="robot", password="hunter2")
    assert "hunter2" not in repr(prepared)


def test_steps_wait_in_the_spec_order_drives_first(preparer: Preparer, data_dir: Path, tmp_path: Path) -> None:
    spec = group(
        drives=[{"name": "data", "host_path": str(tmp_path / "none"), "mount_path": "/data"}],
        secrets=[{"name": "hf", "key": "token", "env": "HF_TOKEN"}],
        registry_secret="regcred",
    )
    reasons = []
    for make_ready in (
        lambda: (tmp_path / "none").mkdir(),
        lambda: put_secret(data_dir, "hf", "token", "t"),
    ):
        waiting = preparer.prepare(KEY, spec)
        assert isinstance(waiting, Waiting)
        reasons.append(waiting.reason.code)
        make_ready()
    waiting = preparer.prepare(KEY, spec)
    assert isinstance(waiting, Waiting)
    reasons.append(waiting.reason.code)

    assert reasons == ["WaitingForDataVolume", "WaitingForExternalSecret", "WaitingForRegistrySecret"]


def test_forget_removes_the_files_of_attempts_that_ended(preparer: Preparer, data_dir: Path) -> None:
    put_secret(data_dir, "db", "password", "x")
    spec = group(secrets=[{"name": "db", "key": "password", "path": "/run/secrets/db"}])
    other = TaskRef(namespace="team-a", job="llm", task_id="train-1", attempt=1)
    preparer.prepare(KEY, spec)
    preparer.prepare(other, spec)

    preparer.forget(keep=[KEY.slug])

    assert sorted(os.listdir(data_dir / "config")) == [KEY.slug]
