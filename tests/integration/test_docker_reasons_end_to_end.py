"""Reasons of a machine that runs workers as containers, end to end: a real cluster whose agent runs `--runtime
docker` against a Docker engine the tests started, images pulled from a registry on loopback. A pull that succeeds
then starts (alone, and through a gang's barrier), and an engine that refuses to create a container."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docker_engine import DockerEngine
from tests.integration.harness import Cluster, pairs
from tests.local_registry import LocalRegistry

pytestmark = pytest.mark.integration

GIB = 2**30
NODE = "dr0"


@pytest.fixture(scope="module")
def registry(docker_engine: DockerEngine) -> Iterator[LocalRegistry]:
    local = LocalRegistry(docker_engine.root / "rootfs.tar")  # the rootfs the engine's busybox image was made of
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, docker_engine: DockerEngine) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("docker-reasons"))
    flags = ["--runtime", "docker", "--docker-host", docker_engine.host, "--cpus", "8", "--memory-bytes", str(8 * GIB)]
    try:
        c.start({NODE: flags})
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, groups: list[dict[str, Any]], **fields: Any) -> None:
    spec = {"name": name, "groups": [{"restart_policy": "Never", "cpu": 0.5, **g} for g in groups], **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def from_state(history: list[tuple[str, str]], state: str) -> list[tuple[str, str]]:
    """The history from its first entry in `state` on (what came before is the placement's)."""
    return history[[s for s, _ in history].index(state) :]


def test_a_pulled_image_starts(cluster: Cluster, tmp_path: Path, registry: LocalRegistry) -> None:
    image = registry.add("team/app", "1")
    submit(cluster, tmp_path, "rr-pull", [{"name": "w", "image": image, "command": ["sh", "-c", "echo pulled"]}])

    described = cluster.wait_state("rr-pull", "Completed", "Failed")

    assert described["status"]["reason"] == "All workers completed"
    assert from_state(pairs(described["tasks"][0]["history"]), "Pulling") == [
        ("Pulling", f"Pulling {image}"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
        ("Completed", "Exited with code 0"),
    ]
    assert registry.pulls == ["team/app:1"]
    assert cluster.cli("logs", "rr-pull/w-0").stdout == "pulled\n"


def test_gang_members_pull_then_wait_at_the_barrier(cluster: Cluster, tmp_path: Path, registry: LocalRegistry) -> None:
    image = registry.add("team/gang", "1")
    group = {"name": "w", "replicas": 2, "image": image, "pull_policy": "Always", "command": ["true"]}
    submit(cluster, tmp_path, "rr-gang", [group], gang=True)

    described = cluster.wait_state("rr-gang", "Completed", "Failed")

    assert described["status"]["reason"] == "All workers completed"
    for worker in described["tasks"]:
        assert from_state(pairs(worker["history"]), "Pulling") == [
            ("Pulling", f"Pulling {image}"),
            ("ReadyToStart", "Waiting at the gang barrier"),
            ("Starting", "Container started"),
            ("Running", "Container running"),
            ("Completed", "Exited with code 0"),
        ]
    assert ("Starting", "Starting together: 2 of 2 ready") in pairs(described["history"])


def test_a_container_the_engine_refuses_to_create_fails_its_worker(
    cluster: Cluster, tmp_path: Path, docker_engine: DockerEngine
) -> None:
    # An image that declares a volume over one of its files: the engine refuses the container (500), not the request.
    rootfs = str(docker_engine.root / "rootfs.tar")
    docker_engine.docker("import", "--change", 'VOLUME ["/etc/passwd"]', rootfs, "local/badvolume:1")
    submit(cluster, tmp_path, "rr-create", [{"name": "w", "image": "local/badvolume:1", "command": ["true"]}])

    described = cluster.wait_state("rr-create", "Failed", "Completed")

    state, reason = pairs(described["tasks"][0]["history"])[-1]
    # The engine names the file in the container's root, under a layer of its own making.
    layers = re.escape(str(docker_engine.root / "data" / "overlay2"))
    refused = (
        "Container create failed: cannot mount volume over existing file, file exists "
        rf"{layers}/[0-9a-f]{{64}}/merged/etc/passwd"
    )
    assert state == "Failed" and re.fullmatch(refused, reason), reason
    assert described["status"]["reason"] == f"Worker w-0 failed on {NODE}: {reason}"
    assert described["tasks"][0]["last_failure"]["reason"] == reason
