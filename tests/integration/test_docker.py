"""Runs on a real cluster whose machine runs workers as containers: the dev server, a control plane, a scheduler and
`astraeus agent --runtime docker` against a Docker engine the tests started, images made with `docker import`."""

from __future__ import annotations

import json
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.docker_engine import IMAGE, DockerEngine
from tests.integration.harness import Cluster, pairs
from workers.devserver import free_port

pytestmark = pytest.mark.integration

GIB = 2**30
NODE = "d0"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, docker_engine: DockerEngine) -> Iterator[Cluster]:
    # The machine's lease outlasts an agent restart (kill -9, then start again): its workers are re-attached, not
    # lost. A lease shorter than the restart would make the machine Down and its workers lost, as it should.
    c = Cluster(tmp_path_factory.mktemp("docker-cluster"), node_lease_ttl_seconds=30)
    try:
        c.start({NODE: agent_flags(docker_engine)})
        yield c
    finally:
        c.stop()


EXTERNAL_PORT = free_port()  # the one port d0 assigns to workers' external access


def agent_flags(engine: DockerEngine) -> list[str]:
    return ["--runtime", "docker", "--docker-host", engine.host, "--cpus", "8", "--memory-bytes", str(8 * GIB),
            "--external-ports", f"{EXTERNAL_PORT}-{EXTERNAL_PORT}"]  # fmt: skip


def submit(cluster: Cluster, tmp_path: Path, name: str, **group: Any) -> None:
    spec = {"name": name, "groups": [{"name": "w", "image": IMAGE, "restart_policy": "Never", **group}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def container(engine: DockerEngine, run: str, attempt: int = 0) -> dict[str, Any]:
    return json.loads(engine.docker("inspect", f"astraeus.default.{run}.w-0.{attempt}"))[0]  # type: ignore[no-any-return]


def test_a_container_runs_to_completion_and_its_log_is_kept(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "dk-hello", command=["sh", "-c", "echo hello from $ASTRAEUS_TASK on $ASTRAEUS_NODE"])

    described = cluster.wait_state("dk-hello", "Completed", "Failed")

    assert described["status"]["reason"] == "All workers completed"
    assert pairs(described["tasks"][0]["history"]) == [
        ("Pending", "Waiting for workers to start"),
        ("Pending", f"Placed on {NODE}"),
        ("Preparing", f"Picked up by {NODE}"),
        ("Starting", "Container started"),
        ("Running", "Container running"),
        ("Completed", "Exited with code 0"),
    ]
    assert cluster.cli("logs", "dk-hello/w-0").stdout == f"hello from w-0 on {NODE}\n"


def test_a_container_that_exits_3_fails_its_run_with_its_log(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "dk-fail", command=["sh", "-c", "echo boom >&2; exit 3"])

    described = cluster.wait_state("dk-fail", "Failed", "Completed")

    assert described["status"]["reason"] == f"Worker w-0 failed on {NODE}: Exited with code 3"
    failure = described["tasks"][0]["last_failure"]
    assert (failure["exit_code"], failure["reason"], failure["log_tail"]) == (3, "Exited with code 3", "boom\n")


def test_a_container_over_its_memory_limit_is_oom_killed(
    cluster: Cluster, tmp_path: Path, docker_engine: DockerEngine
) -> None:
    command = ["sh", "-c", "x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo survived"]
    submit(cluster, tmp_path, "dk-oom", command=command, memory_bytes=16 << 20)

    described = cluster.wait_state("dk-oom", "Failed", "Completed")

    reason = "OOMKilled: the container exceeded its memory limit"
    assert described["status"]["reason"] == f"Worker w-0 failed on {NODE}: {reason}"
    assert described["tasks"][0]["last_failure"]["reason"] == reason
    assert container(docker_engine, "dk-oom")["HostConfig"]["Memory"] == 16 << 20


def test_an_image_that_is_not_present_under_pull_policy_none_fails_without_pulling(
    cluster: Cluster, tmp_path: Path
) -> None:
    submit(cluster, tmp_path, "dk-none", command=["true"], image="local/missing:1", pull_policy="None")

    described = cluster.wait_state("dk-none", "Failed", "Completed")

    reason = "Image local/missing:1 is not present and the pull policy is None"
    assert described["status"]["reason"] == f"Worker w-0 failed on {NODE}: {reason}"
    assert pairs(described["tasks"][0]["history"])[-2:] == [("Preparing", f"Picked up by {NODE}"), ("Failed", reason)]


def test_a_pull_is_reported_and_a_failed_pull_fails_the_worker(cluster: Cluster, tmp_path: Path) -> None:
    image = f"127.0.0.1:{free_port()}/team/train:1"  # a registry on loopback that does not answer
    submit(cluster, tmp_path, "dk-pull", command=["true"], image=image)

    described = cluster.wait_state("dk-pull", "Failed", "Completed")

    history = pairs(described["tasks"][0]["history"])
    assert history[-2] == ("Pulling", f"Pulling {image}")
    assert history[-1][0] == "Failed" and history[-1][1].startswith("ErrImagePull: ")
    assert "connection refused" in history[-1][1]


def test_a_container_stopped_mid_run_ends_cancelled(
    cluster: Cluster, tmp_path: Path, docker_engine: DockerEngine
) -> None:
    submit(cluster, tmp_path, "dk-stop", command=["sleep", "600"])
    cluster.wait_state("dk-stop", "Running")

    cluster.cli("stop", "dk-stop/w-0", "--reason", "Making room")

    described = cluster.wait_state("dk-stop", "Cancelled", "Failed", "Completed")
    assert pairs(described["tasks"][0]["history"])[-2:] == [
        ("Stopping", "Making room"),
        ("Cancelled", "Stopped on request"),
    ]
    state = container(docker_engine, "dk-stop")["State"]
    assert (state["Running"], state["ExitCode"]) == (False, 137)  # sleep ignores SIGTERM as PID 1: killed


def test_a_restarted_agent_reattaches_without_starting_the_container_twice(
    cluster: Cluster, tmp_path: Path, docker_engine: DockerEngine
) -> None:
    submit(cluster, tmp_path, "dk-reattach", command=["sh", "-c", "echo started; sleep 8; echo done"])
    cluster.wait_state("dk-reattach", "Running")
    started_at = container(docker_engine, "dk-reattach")["State"]["StartedAt"]

    cluster.kill(NODE, signal.SIGKILL)
    cluster.spawn_agent(NODE, *agent_flags(docker_engine))

    described = cluster.wait_state("dk-reattach", "Completed", "Failed", timeout=90)
    assert described["status"]["reason"] == "All workers completed"
    task = described["tasks"][0]
    assert task["restarts"] == 0
    assert [e for e in task["history"] if e["state"] == "Starting"] == [task["history"][3]]  # started once
    state = container(docker_engine, "dk-reattach")["State"]
    assert (state["StartedAt"], state["ExitCode"]) == (started_at, 0)
    assert cluster.cli("logs", "dk-reattach/w-0").stdout == "started\ndone\n"


def test_a_worker_waits_for_its_secret_then_gets_it_as_a_variable_and_a_file(cluster: Cluster, tmp_path: Path) -> None:
    secrets = [
        {"name": "hf", "key": "token", "env": "HF_TOKEN"},
        {"name": "hf", "key": "token", "path": "/run/secrets/hf-token"},
    ]
    command = ["sh", "-c", 'echo "env=$HF_TOKEN file=$(cat /run/secrets/hf-token)"']
    submit(cluster, tmp_path, "dk-secret", command=command, secrets=secrets)
    waiting = "waiting for external secret hf (key token) to be synced to this node"
    cluster.wait_for(
        lambda: cluster.describe("dk-secret")["tasks"][0]["status"]["reason"] == waiting, "the worker to wait"
    )
    assert cluster.describe("dk-secret")["status"] == cluster.describe("dk-secret")["status"] | {"reason": waiting}

    token = cluster.agent_dir(NODE) / "secrets" / "hf" / "token"
    token.parent.mkdir(parents=True)
    token.write_text("hf_abc")

    described = cluster.wait_state("dk-secret", "Completed", "Failed")
    assert pairs(described["tasks"][0]["history"])[1:4] == [
        ("Pending", f"Placed on {NODE}"),
        ("Preparing", f"Picked up by {NODE}"),
        ("Preparing", waiting),
    ]
    assert cluster.cli("logs", "dk-secret/w-0").stdout == "env=hf_abc file=hf_abc\n"
    assert "hf_abc" not in json.dumps(described)


def test_logs_of_a_worker_not_on_a_machine_say_so(cluster: Cluster, tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    path.write_text(textwrap.dedent(f"name: dk-big\ngroups: [{{name: w, image: '{IMAGE}', command: [x], gpus: 64}}]\n"))
    cluster.cli("submit", str(path))
    cluster.wait_for(lambda: cluster.describe("dk-big")["placement"]["nodes"], "dk-big to wait")

    result = cluster.cli("logs", "dk-big/w-0", check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == "astraeus: worker w-0 of run dk-big is on no machine now (Pending)"
    unknown = cluster.cli("logs", "dk-big/w-9", check=False)
    assert (unknown.returncode, unknown.stderr.strip()) == (3, "astraeus: run default/dk-big has no worker w-9")
    cluster.cli("cancel", "dk-big")


def test_a_deleted_runs_container_and_its_log_leave_the_engine(
    cluster: Cluster, tmp_path: Path, docker_engine: DockerEngine
) -> None:
    submit(cluster, tmp_path, "dk-gone", command=["sh", "-c", "echo bye; sleep 60"])
    cluster.wait_state("dk-gone", "Running")
    assert container(docker_engine, "dk-gone")["State"]["Running"]

    assert cluster.cli("delete", "dk-gone").stdout == "deleted default/dk-gone (it was Cancelled)\n"

    with pytest.raises(RuntimeError, match="No such object"):
        container(docker_engine, "dk-gone")
    assert cluster.cli("describe", "dk-gone", check=False).returncode == 3


def test_a_containers_external_access_is_bound_to_the_port_its_machine_assigned(
    cluster: Cluster, tmp_path: Path, docker_engine: DockerEngine
) -> None:
    access = [{"name": "web", "port": 8080}]
    submit(cluster, tmp_path, "dk-web", command=["sh", "-c", "env | grep PORT_WEB | sort; sleep 600"],
           external_access=access)  # fmt: skip
    described = cluster.wait_state("dk-web", "Running")

    assert described["tasks"][0]["external"] == {"web": f"127.0.0.1:{EXTERNAL_PORT}"}
    bindings = container(docker_engine, "dk-web")["HostConfig"]["PortBindings"]
    assert bindings == {"8080/tcp": [{"HostIp": "", "HostPort": str(EXTERNAL_PORT)}]}
    expected = f"ASTRAEUS_EXTERNAL_PORT_WEB={EXTERNAL_PORT}\nASTRAEUS_PORT_WEB=8080\n"
    cluster.wait_for(lambda: cluster.cli("logs", "dk-web/w-0").stdout == expected, "the worker to print its ports")
    cluster.cli("cancel", "dk-web")
    cluster.wait_state("dk-web", "Cancelled")
