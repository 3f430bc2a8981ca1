"""Sandboxed workers, end to end: a real cluster whose agents run `--runtime docker` against a Docker engine the
tests started with gVisor's runsc registered (tests/docker_engine.py). A machine whose engine has it runs a
sandboxed worker under gVisor; one whose sandbox runtime refuses every container fails the worker with "Agent
sandbox: <why>"; one whose engine lacks the runtime says so in its per-machine reason. A person attaches to a
sandboxed worker: the command is exec'd in its container, under gVisor."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docker_engine import IMAGE, DockerEngine, sandbox_missing
from tests.integration.harness import Cluster
from tests.integration.test_interactive import astraeus as attach_as_a_person

pytestmark = pytest.mark.integration

GIB = 2**30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, docker_engine: DockerEngine) -> Iterator[Cluster]:
    why = sandbox_missing()
    if why is not None:
        pytest.skip(why)
    c = Cluster(tmp_path_factory.mktemp("docker-capabilities"))
    flags = ["--runtime", "docker", "--docker-host", docker_engine.host, "--cpus", "4", "--memory-bytes", str(4 * GIB)]
    try:
        c.start(
            {
                "boxed": flags,
                "broken": [*flags, "--sandbox-runtime", "broken-sandbox"],
                "bare": [*flags, "--sandbox-runtime", "kata"],
            }
        )
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, node: str, **group: Any) -> None:
    group = {"name": "w", "image": IMAGE, "restart_policy": "Never", "cpu": 0.5, **group}
    spec = {"name": name, "groups": [group], "node_selection": {"names": [node]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def test_a_sandboxed_worker_runs_under_gvisor(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "boxed", "boxed", command=["sh", "-c", "dmesg | head -1"], capabilities={"sandbox": True})
    described = cluster.wait_state("boxed", "Completed", "Failed")
    assert described["status"]["reason"] == "All workers completed"
    assert cluster.cli("logs", "boxed/w-0").stdout.split("] ", 1)[1] == "Starting gVisor...\n"


def test_a_sandbox_runtime_that_refuses_the_container_fails_the_worker(
    cluster: Cluster, tmp_path: Path, docker_engine: DockerEngine
) -> None:
    submit(cluster, tmp_path, "refused", "broken", command=["true"], capabilities={"sandbox": True})
    described = cluster.wait_state("refused", "Failed", "Completed")
    reason = described["tasks"][0]["status"]["reason"]
    # The engine names the container's own task directory, under its exec root.
    tasks = re.escape(f"{docker_engine.root}/exec/containerd/daemon/io.containerd.runtime.v2.task/moby/")
    refused = (
        "Agent sandbox: failed to create shim task: OCI runtime create failed: unable to retrieve OCI runtime error "
        rf"\(open {tasks}[0-9a-f]{{64}}/log.json: no such file or directory\): /bin/false did not terminate "
        "successfully: exit status 1: unknown"
    )
    assert re.fullmatch(refused, reason), reason
    assert described["status"]["reason"] == f"Worker w-0 failed on broken: {reason}"


def test_a_machine_whose_engine_lacks_the_sandbox_runtime_says_so(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "unboxed", "bare", command=["true"], capabilities={"sandbox": True})
    described = cluster.wait_for(lambda: (d := cluster.describe("unboxed"))["placement"]["nodes"] and d, "to wait")
    [bare] = [n for n in described["placement"]["nodes"] if n["name"] == "bare"]
    assert bare["reasons"] == [
        "machine cannot run sandboxed workers (gVisor's kata is not registered with its Docker engine (it has "
        "broken-sandbox, io.containerd.runc.v2, io.containerd.runtime.v1.linux, runc, runsc))"
    ]
    cluster.cli("cancel", "unboxed")


def test_a_person_attaches_to_a_sandboxed_worker_in_its_container(cluster: Cluster, tmp_path: Path) -> None:
    wanted = {"sandbox": True, "interactive_token": True}
    submit(
        cluster, tmp_path, "shell", "boxed", command=["sleep", "300"], env={"GREETING": "hello"}, capabilities=wanted
    )
    cluster.wait_state("shell", "Running")
    token = attach_as_a_person(cluster, "interactive-token", "shell/w-0").stdout.strip()
    inside = attach_as_a_person(cluster, "attach", "shell/w-0", "--", "sh", "-c", "echo $GREETING; dmesg | head -1")
    assert inside.returncode == 0, inside.stderr
    assert inside.stdout.splitlines()[0] == "hello" and "Starting gVisor..." in inside.stdout  # in its sandbox
    shell = attach_as_a_person(cluster, "attach", "shell/w-0", "--token", token, stdin="echo $GREETING\nexit 5\n")
    assert (shell.returncode, shell.stdout) == (5, "hello\n")
    cluster.cli("cancel", "shell")
