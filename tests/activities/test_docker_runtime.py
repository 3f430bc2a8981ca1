"""The docker runtime against a real Docker engine (dockerd started by the tests): pulls under each policy, limits,
exit codes, OOM, stops, logs, labels, mounts, a runtime that restarts and finds its containers again, the image made
ready at the gang barrier, and readiness checks (a command exec'd in the container, an HTTP GET to its address)."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
from docker.models.containers import Container
from temporalio.client import Client

from activities.agent.drives import DriveStore
from activities.agent.identities import Identities
from activities.agent.prepare import Preparer
from activities.agent.runtime.base import (
    EXEC_TIMED_OUT,
    ExecRefused,
    Launch,
    Mount,
    NetworkNotUp,
    Observed,
    RuntimeFailure,
    RuntimeUnavailable,
)
from activities.agent.runtime.containers import container_name
from activities.agent.runtime.docker import DockerRuntime, container_address
from activities.agent.starter import SetupEnded, Starter
from activities.identity import AttemptIdentity, ClusterCA, spiffe_id
from tests.activities.runtimes import check, probe_until, wait_until_ended
from tests.docker_engine import IMAGE, DockerEngine
from workers.devserver import free_port
from workflows.domain.constraints import Drive
from workflows.domain.group_parts import DriveSpec
from workflows.domain.machine.attempts import PortMapping
from workflows.domain.reasons import Reason
from workflows.domain.refs import TaskRef
from workflows.domain.spec import GroupSpec

_attempts = itertools.count(1)


def key(task: str = "w-0") -> TaskRef:
    """A new attempt each time: the engine is shared by every test of the session."""
    return TaskRef(namespace="team-a", job="unit", task_id=task, attempt=next(_attempts))


def sh(script: str, **fields: object) -> Launch:
    return Launch(command=["sh", "-c", script], **{"image": IMAGE, **fields})  # type: ignore[arg-type]


def inspect(engine: DockerEngine, task_key: TaskRef) -> dict[str, object]:
    return json.loads(engine.docker("inspect", container_name(task_key)))[0]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def runtime(docker_engine: DockerEngine) -> Iterator[DockerRuntime]:
    runtime = DockerRuntime("unit-node", docker_engine.host)
    yield runtime
    runtime.close()


def test_a_worker_that_exits_0_is_seen_running_then_ended_with_its_output(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("echo out; sleep 0.2; echo err >&2; sleep 0.3; echo $ASTRAEUS_TASK $ASTRAEUS_ATTEMPT"))

    assert runtime.observe(k).running
    assert wait_until_ended(runtime, k) == Observed(running=False, exit_code=0)
    assert runtime.log_tail(k, lines=50, max_bytes=16384) == f"out\nerr\nw-0 {k.attempt}\n"
    assert runtime.log_tail(k, lines=1, max_bytes=16384) == f"w-0 {k.attempt}\n"
    assert runtime.log_tail(k, lines=50, max_bytes=4) == f"w-0 {k.attempt}\n"[-4:]


def test_a_worker_that_exits_3_ends_with_code_3(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("echo boom >&2; exit 3"))

    assert wait_until_ended(runtime, k) == Observed(running=False, exit_code=3)
    assert runtime.log_tail(k, lines=50, max_bytes=16384) == "boom\n"


def test_a_worker_over_its_memory_limit_is_oom_killed(runtime: DockerRuntime, docker_engine: DockerEngine) -> None:
    k = key()
    runtime.start(k, sh("x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo survived", memory_bytes=16 << 20))

    assert wait_until_ended(runtime, k) == Observed(running=False, exit_code=137, oom=True)
    assert inspect(docker_engine, k)["HostConfig"]["Memory"] == 16 << 20  # type: ignore[index]


class LateOomEvent(DockerRuntime):
    """The engine as dockerd 20.10 leaves it when a container's out-of-memory event reaches it after the exit
    (seen under load in CI): `OOMKilled` false, the kill only in its events."""

    def _find(self, key: TaskRef) -> Container | None:
        container = super()._find(key)
        if container is not None:
            container.attrs["State"]["OOMKilled"] = False
        return container


def test_an_oom_kill_the_engine_heard_of_after_the_exit_still_counts(docker_engine: DockerEngine) -> None:
    late = LateOomEvent("unit-node", docker_engine.host)
    k = key()
    late.start(k, sh("x=$(head -c 67108864 /dev/zero | tr '\\0' a); echo survived", memory_bytes=16 << 20))

    assert wait_until_ended(late, k) == Observed(running=False, exit_code=137, oom=True)
    late.close()


def test_a_worker_killed_with_room_to_spare_is_not_oom_killed(docker_engine: DockerEngine) -> None:
    late = LateOomEvent("unit-node", docker_engine.host)
    k = key()
    late.start(k, sh("sleep 30", memory_bytes=16 << 20))
    late.stop(k, grace_seconds=0)

    assert wait_until_ended(late, k) == Observed(running=False, exit_code=137, oom=False)
    late.close()


def test_cpu_memory_env_and_labels_reach_the_container(runtime: DockerRuntime, docker_engine: DockerEngine) -> None:
    k = key("train-3")
    runtime.start(k, sh("true", cpu=0.5, memory_bytes=64 << 20, env={"MODEL": "7b"}))

    container = inspect(docker_engine, k)
    host, config = container["HostConfig"], container["Config"]
    assert (host["NanoCpus"], host["Memory"]) == (500_000_000, 64 << 20)  # type: ignore[index]
    assert "MODEL=7b" in config["Env"] and "ASTRAEUS_TASK=train-3" in config["Env"]  # type: ignore[index]
    labels = config["Labels"]  # type: ignore[index]
    assert labels == {
        "astraeus.namespace": "team-a",
        "astraeus.job": "unit",
        "astraeus.task": "train-3",
        "astraeus.attempt": str(k.attempt),
        "astraeus.node": "unit-node",
        "astraeus.gpus": "",
        "astraeus.ports": "",
    }


def test_an_image_that_is_not_present_fails_under_pull_policy_none_without_pulling(runtime: DockerRuntime) -> None:
    progress: list[Reason] = []
    with pytest.raises(RuntimeFailure) as failure:
        runtime.start(key(), sh("true", image="local/missing:1", pull_policy="None"), progress.append)

    assert failure.value.reason.text == "Image local/missing:1 is not present and the pull policy is None"
    assert progress == []


def test_a_missing_image_is_pulled_under_if_not_present_and_a_failed_pull_says_why(runtime: DockerRuntime) -> None:
    image = f"127.0.0.1:{free_port()}/missing:1"  # a registry on loopback that does not answer
    progress: list[Reason] = []
    with pytest.raises(RuntimeFailure) as failure:
        runtime.start(key(), sh("true", image=image), progress.append)

    assert [r.text for r in progress] == [f"Pulling {image}"]
    assert failure.value.reason.code == "ErrImagePull"
    assert failure.value.reason.text.startswith("ErrImagePull: ")
    assert "connection refused" in failure.value.reason.text


def test_pull_policy_always_pulls_even_a_present_image(runtime: DockerRuntime, docker_engine: DockerEngine) -> None:
    image = f"127.0.0.1:{free_port()}/busybox:always"
    docker_engine.docker("tag", IMAGE, image)
    progress: list[Reason] = []

    runtime.start(key(), sh("true", image=image, pull_policy="IfNotPresent"), progress.append)
    assert progress == []
    with pytest.raises(RuntimeFailure) as failure:
        runtime.start(key(), sh("true", image=image, pull_policy="Always"), progress.append)
    assert [r.text for r in progress] == [f"Pulling {image}"]
    assert failure.value.reason.code == "ErrImagePull"


def test_a_stop_sends_sigterm_first(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("trap 'echo got TERM; exit 0' TERM; while true; do sleep 0.1; done"))
    time.sleep(0.3)  # let the shell set its trap

    runtime.stop(k, grace_seconds=10)

    assert runtime.observe(k) == Observed(running=False, exit_code=0)
    assert runtime.log_tail(k, lines=5, max_bytes=1024) == "got TERM\n"


def test_a_stop_kills_a_worker_that_ignores_sigterm_after_the_grace_period(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("trap '' TERM; while true; do sleep 0.1; done"))
    time.sleep(0.3)

    began = time.monotonic()
    runtime.stop(k, grace_seconds=1)

    assert runtime.observe(k) == Observed(running=False, exit_code=137)
    assert 0.9 <= time.monotonic() - began < 10
    runtime.stop(k, grace_seconds=1)  # stopping an ended worker does nothing


def test_a_second_start_of_an_attempt_never_starts_it_twice(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("echo started"))
    wait_until_ended(runtime, k)

    runtime.start(k, sh("echo started"))  # a retried start, after the worker ended

    assert runtime.log_tail(k, lines=50, max_bytes=1024) == "started\n"
    assert runtime.observe(k) == Observed(running=False, exit_code=0)


def test_a_runtime_that_restarts_finds_its_containers_and_their_gpus(
    runtime: DockerRuntime, docker_engine: DockerEngine
) -> None:
    k = key("long-0")
    runtime.start(k, sh("sleep 30"))
    again = DockerRuntime("unit-node", docker_engine.host)  # the agent restarted
    try:
        assert again.observe(k).running
        assert k in again.attempts()
        assert again.gpus_in_use()[k.slug] == []
        assert k not in DockerRuntime("other-node", docker_engine.host).attempts()
        assert k in again.running()
        again.stop(k, grace_seconds=0)
        assert runtime.observe(k) == Observed(running=False, exit_code=137)
        assert k.slug not in again.gpus_in_use()
        assert k not in again.running()
        assert k in again.attempts()
    finally:
        again.close()


def test_gpus_are_requested_from_the_nvidia_runtime_which_this_engine_lacks(runtime: DockerRuntime) -> None:
    with pytest.raises(RuntimeFailure) as failure:
        runtime.start(key(), sh("true", gpu_indices=[0, 1]))

    # dockerd 20.10 checks device requests when the container starts.
    assert failure.value.reason.text == (
        'Container start failed: could not select device driver "nvidia" with capabilities: [[gpu]]'
    )


def test_a_program_missing_from_the_image_cannot_start(runtime: DockerRuntime) -> None:
    with pytest.raises(RuntimeFailure) as failure:
        runtime.start(key(), Launch(command=["/no/such/program"], image=IMAGE))

    assert failure.value.reason.code == "ContainerStartFailed"
    assert "/no/such/program" in failure.value.reason.text


@pytest.mark.parametrize(
    ("launch", "error"),
    [
        pytest.param(Launch(command=["true"]), "no image: the docker runtime runs a container image", id="no image"),
        pytest.param(
            sh("true", memory_bytes=1 << 20), "Minimum memory limit allowed is 6MB", id="a memory limit too small"
        ),
        pytest.param(
            sh("true", mounts=[Mount(target="/data", source="/no/such/dir")]),
            'invalid mount config for type "bind": bind source path does not exist: /no/such/dir',
            id="a host path the engine refuses",
        ),
    ],
)
def test_a_task_the_engine_refuses_is_invalid(runtime: DockerRuntime, launch: Launch, error: str) -> None:
    with pytest.raises(RuntimeFailure) as failure:
        runtime.start(key(), launch)

    assert failure.value.reason.text == f"Invalid task: {error}"


def test_drives_and_files_are_mounted(runtime: DockerRuntime, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-0").write_text("tokens\n")
    (tmp_path / "token").write_text("s3cret")
    mounts = [
        Mount(target="/data", source=str(tmp_path / "data"), read_only=True),
        Mount(target="/cache", source=f"astraeus-test-cache-{next(_attempts)}", kind="volume"),
        Mount(target="/run/secrets/token", source=str(tmp_path / "token"), read_only=True),
    ]
    k = key()
    script = "cat /data/shard-0 /run/secrets/token; echo; touch /cache/ok && echo cache; touch /data/x 2>&- || echo ro"
    runtime.start(k, sh(script, mounts=mounts))

    assert wait_until_ended(runtime, k).exit_code == 0
    assert runtime.log_tail(k, lines=50, max_bytes=4096) == "tokens\ns3cret\ncache\nro\n"


def test_a_container_removed_from_the_machine_is_not_found(runtime: DockerRuntime, docker_engine: DockerEngine) -> None:
    k = key()
    runtime.start(k, sh("sleep 30"))
    docker_engine.docker("rm", "--force", container_name(k))

    assert runtime.observe(k) == Observed(running=False, not_found=True)
    assert runtime.log_tail(k, lines=5, max_bytes=100) == ""
    runtime.stop(k, grace_seconds=1)


def test_deleting_an_ended_attempt_removes_its_container_and_log(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("sleep 30"))
    with pytest.raises(ValueError, match="still runs"):
        runtime.delete(k)
    runtime.stop(k, grace_seconds=0)

    runtime.delete(k)

    assert runtime.observe(k).not_found
    assert k not in runtime.attempts()
    runtime.delete(k)


def test_an_engine_that_does_not_answer_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(RuntimeUnavailable, match=r"^the Docker engine at unix://.*/none.sock does not answer: "):
        DockerRuntime("n0", f"unix://{tmp_path}/none.sock")


# ---- the gang barrier: the image made ready, nothing created ----------------------------------------------------


def test_ensure_image_pulls_under_the_policy_and_creates_nothing(
    runtime: DockerRuntime, docker_engine: DockerEngine
) -> None:
    image = f"127.0.0.1:{free_port()}/busybox:barrier"
    docker_engine.docker("tag", IMAGE, image)
    progress: list[Reason] = []

    runtime.ensure_image(sh("true", image=image, pull_policy="IfNotPresent"), progress.append)
    runtime.ensure_image(sh("true", image=image, pull_policy="None"), progress.append)
    assert progress == []
    with pytest.raises(RuntimeFailure) as failure:
        runtime.ensure_image(sh("true", image=image, pull_policy="Always"), progress.append)
    assert [r.text for r in progress] == [f"Pulling {image}"]
    assert failure.value.reason.code == "ErrImagePull"
    with pytest.raises(RuntimeFailure, match=r"^Image local/missing:2 is not present and the pull policy is None$"):
        runtime.ensure_image(sh("true", image="local/missing:2", pull_policy="None"))
    assert not [c for c in docker_engine.docker("ps", "--all", "--quiet").split() if image in c]


async def test_a_barrier_setup_pulls_then_the_start_runs_it_without_pulling_again(
    runtime: DockerRuntime, docker_engine: DockerEngine, tmp_path: Path
) -> None:
    reported: list[str] = []

    async def report(_: TaskRef, reason: Reason) -> None:
        reported.append(reason.text)

    starter = Starter(runtime, Preparer(tmp_path), lambda: [], report, retry_seconds=0.05)
    k = key()
    spec = GroupSpec(name="w", command=["sleep", "30"], image=IMAGE, pull_policy="Always")
    with pytest.raises(SetupEnded) as ended:  # Always pulls, even at the barrier; no registry answers here
        await starter.ready(k, spec, {}, lambda _: None)
    assert ended.value.reason.code == "ErrImagePull"
    assert reported == [f"Pulling {IMAGE}"]

    k = key()
    spec = spec.model_copy(update={"pull_policy": "IfNotPresent"})
    assert await starter.ready(k, spec, {}, lambda _: None) == ([], False, None)
    assert runtime.observe(k) == Observed(running=False, not_found=True)  # no container yet
    assert await starter.start(k, spec, {"RANK": "0"}, lambda _: None) == []
    assert runtime.observe(k).running
    await starter.stop(k, grace_seconds=0)


# ---- readiness checks ---------------------------------------------------------------------------------------------


def test_a_command_check_is_exec_d_in_the_container(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("sleep 30", env={"TOKEN": "s3cret"}))

    assert runtime.probe(k, check(["sh", "-c", 'test "$TOKEN" = s3cret'])) == (True, "exited with code 0")
    assert runtime.probe(k, check(["test", "-f", "/tmp/ready"])) == (False, "exited with code 1")
    began = time.monotonic()
    assert runtime.probe(k, check(["sleep", "5"], timeout=0.3)) == (False, "timed out after 0.3s")
    assert time.monotonic() - began < 2
    passed, detail = runtime.probe(k, check(["/no/such/check"]))
    assert not passed
    assert "/no/such/check" in detail and "no such file or directory" in detail

    runtime.stop(k, grace_seconds=0)
    assert runtime.probe(k, check(["true"])) == (False, "the container is not running")
    assert runtime.probe(key(), check(["true"])) == (False, "the container is not running")


# ---- interactive sessions ---------------------------------------------------------------------------------------


def test_a_person_s_command_runs_in_the_container_with_its_input_and_output_apart(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("sleep 30", env={"GREETING": "hello"}))

    done = runtime.exec(k, ["sh", "-c", 'echo "$GREETING"; echo oops >&2; exit 3'], b"", 10)
    assert (done.exit_code, done.stdout, done.stderr) == (3, b"hello\n", b"oops\n")
    shell = runtime.exec(k, ["sh"], b"echo $GREETING from a shell\nexit 4\n", 10)
    assert (shell.exit_code, shell.stdout) == (4, b"hello from a shell\n")
    read = runtime.exec(k, ["sh", "-c", "read line; echo got $line"], b"this\n", 10)
    assert (read.exit_code, read.stdout) == (0, b"got this\n")
    began = time.monotonic()
    slow = runtime.exec(k, ["sh", "-c", "echo started; sleep 5"], b"", 0.5)
    assert (slow.exit_code, slow.stdout) == (EXEC_TIMED_OUT, b"started\n")
    assert slow.stderr == b"astraeus: the command ran past its timeout of 0.5 s and was stopped\n"
    assert time.monotonic() - began < 3
    missing = runtime.exec(k, ["/no/such/program"], b"", 10)
    assert missing.exit_code in (126, 127)

    runtime.stop(k, grace_seconds=0)
    with pytest.raises(ExecRefused) as raised:
        runtime.exec(k, ["true"], b"", 10)
    assert str(raised.value) == "the container is not running"


def test_an_http_check_of_a_container_without_an_address_fails(runtime: DockerRuntime) -> None:
    k = key()
    runtime.start(k, sh("sleep 30"))

    # This engine runs without a bridge (--bridge=none), and a network's links stay down in this sandbox.
    assert runtime.probe(k, check(port=8080)) == (False, "the container has no network address")
    runtime.stop(k, grace_seconds=0)


def settings(mode: str, address: str = "", **networks: str) -> SimpleNamespace:
    """A container as the engine describes it: its network mode and its address on each network."""
    described = {name: {"IPAddress": ip} for name, ip in networks.items()}
    return SimpleNamespace(
        attrs={"HostConfig": {"NetworkMode": mode}, "NetworkSettings": {"IPAddress": address, "Networks": described}}
    )


@pytest.mark.parametrize(
    ("container", "address"),
    [
        pytest.param(settings("host"), "127.0.0.1", id="the host network is loopback"),
        pytest.param(settings("default", "172.17.0.2", bridge="172.17.0.2"), "172.17.0.2", id="the default bridge"),
        pytest.param(settings("llm", bridge="", llm="10.1.0.7"), "10.1.0.7", id="a network with an address"),
        pytest.param(settings("none", none=""), None, id="no network"),
    ],
)
def test_an_http_check_reaches_the_container_where_the_engine_put_it(
    container: SimpleNamespace, address: str | None
) -> None:
    assert container_address(container) == address  # type: ignore[arg-type]


def test_an_http_check_of_a_container_on_the_host_network_gets_loopback(runtime: DockerRuntime) -> None:
    k = key()  # a gang member shares the machine's network, so its peers reach it at the machine's address
    port = free_port()
    server = f"mkdir -p /www && echo ok > /www/index.html && httpd -f -p 127.0.0.1:{port} -h /www"
    runtime.start(k, sh(server, host_network=True))
    try:
        assert probe_until(runtime, k, check(port=port)) == "HTTP 200"
    finally:
        runtime.stop(k, grace_seconds=0)


async def test_a_placed_drive_is_filled_then_bind_mounted_read_only_where_the_worker_asked(
    runtime: DockerRuntime, tmp_path: Path
) -> None:
    (tmp_path / "imagenet").mkdir()
    (tmp_path / "imagenet" / "labels.txt").write_text("cat\ndog\n")
    (tmp_path / "data").mkdir()
    drive = Drive(name="imagenet", size_bytes=2**20, node="elsewhere", source=str(tmp_path / "imagenet"))
    reported: list[str] = []

    async def report(_: TaskRef, reason: Reason) -> None:
        reported.append(reason.text)

    async def catalogue() -> dict[str, Drive]:
        return {"imagenet": drive}

    preparer = Preparer(tmp_path / "agent", store=DriveStore("unit-node", tmp_path / "data"))
    starter = Starter(runtime, preparer, lambda: [], report, retry_seconds=0.05, catalogue=catalogue)
    k = key()
    script = 'cat /data/labels.txt; echo "$ASTRAEUS_DRIVE_DATA"; touch /data/x 2>/dev/null || echo read-only'
    spec = GroupSpec(
        name="w",
        command=["sh", "-c", script],
        image=IMAGE,
        drives=[DriveSpec(name="data", drive="imagenet", mount_path="/data")],
    )
    await starter.start(k, spec, {}, lambda _: None)
    assert wait_until_ended(runtime, k) == Observed(running=False, exit_code=0)
    assert runtime.log_tail(k, lines=50, max_bytes=16384) == "cat\ndog\n/data\nread-only\n"
    assert reported == ["Waiting for drive imagenet to be filled on unit-node"]


def test_external_access_maps_the_machines_port_to_the_workers_and_a_restarted_runtime_finds_it(
    runtime: DockerRuntime, docker_engine: DockerEngine
) -> None:
    k = key("web-0")
    host_port = free_port()
    runtime.start(k, sh("sleep 30", ports=[PortMapping("web-ui", 8080, host_port)]))
    again = DockerRuntime("unit-node", docker_engine.host)  # the agent restarted: the port is held still
    try:
        container = inspect(docker_engine, k)
        bindings = container["HostConfig"]["PortBindings"]  # type: ignore[index]
        assert bindings == {"8080/tcp": [{"HostIp": "", "HostPort": str(host_port)}]}
        env = container["Config"]["Env"]  # type: ignore[index]
        # In a container the worker listens on its own port; people use the machine's.
        assert {"ASTRAEUS_PORT_WEB_UI=8080", f"ASTRAEUS_EXTERNAL_PORT_WEB_UI={host_port}"} <= set(env)
        assert container["Config"]["Labels"]["astraeus.ports"] == f"web-ui={host_port}"  # type: ignore[index]
        assert again.ports_in_use()[k.slug] == {"web-ui": host_port}
        again.stop(k, grace_seconds=0)
        assert k.slug not in again.ports_in_use()  # it ended: its port is free again
    finally:
        again.close()


def test_a_workers_identity_is_mounted_read_only_and_named_by_its_variables(
    runtime: DockerRuntime, tmp_path: Path
) -> None:
    k = key("ident-0")
    identities = Identities(cast(Client, None), tmp_path, "unit-node")  # no issue here: the files are made below
    ca = ClusterCA(tmp_path / "ca")
    attempt = AttemptIdentity(identities.directory(k))
    identity = spiffe_id(k.namespace, k.job, k.task_id, k.attempt)
    attempt.keep(ca.sign(attempt.request(identity), identity, timedelta(hours=1), datetime.now(UTC)), b"bundle\n")
    env, mounts = identities.files(k, in_container=True)
    script = 'cat "$ASTRAEUS_IDENTITY_BUNDLE"; head -1 "$ASTRAEUS_IDENTITY_KEY"; echo x > "$ASTRAEUS_IDENTITY_CERT"'
    runtime.start(k, sh(script, env=env, mounts=mounts))

    assert wait_until_ended(runtime, k) == Observed(running=False, exit_code=1)  # read-only: it cannot write
    log = runtime.log_tail(k, lines=50, max_bytes=16384)
    refused = [line for line in log.splitlines() if "Read-only file system" in line]  # stderr: in any order
    assert [line for line in log.splitlines() if line not in refused] == ["bundle", "-----BEGIN PRIVATE KEY-----"]
    assert len(refused) == 1


def test_the_node_network_is_made_with_its_subnet_and_replaced_only_while_no_worker_is_on_it(
    runtime: DockerRuntime, docker_engine: DockerEngine
) -> None:
    def subnet_of(name: str) -> str:
        return json.loads(docker_engine.docker("network", "inspect", name))[0]["IPAM"]["Config"][0]["Subnet"]  # type: ignore[no-any-return]

    name = runtime.node_network("10.202.0.0/24")
    try:
        assert (name, subnet_of(name)) == ("astraeus-node-unit-node", "10.202.0.0/24")
        made = json.loads(docker_engine.docker("network", "inspect", name))[0]
        assert runtime.node_bridge() == f"br-{made['Id'][:12]}"  # the bridge the mesh's firewall rules name
        assert Path(f"/sys/class/net/{runtime.node_bridge()}").exists()
        assert runtime.node_network("10.202.0.0/24") == name  # there already: left as it is
        assert subnet_of(runtime.node_network("10.202.1.0/24")) == "10.202.1.0/24"  # the machine was given another

        k = key()
        runtime.start(k, sh("ip -4 -o addr show eth0; sleep 30", network=name, network_alias="w-0.unit.team-a"))
        attached = inspect(docker_engine, k)["NetworkSettings"]["Networks"][name]  # type: ignore[index]
        assert attached["IPAddress"].startswith("10.202.1.")
        assert "w-0.unit.team-a" in attached["Aliases"]
        with pytest.raises(NetworkNotUp) as refused:
            runtime.node_network("10.202.2.0/24")  # a worker is on it: it stays, and the machine waits
        assert "has active endpoints" in str(refused.value)
        runtime.stop(k, grace_seconds=0)
        runtime.delete(k)
    finally:
        with contextlib.suppress(RuntimeError):  # a failed test may leave its worker on it
            docker_engine.docker("network", "rm", name)


def test_an_address_held_on_the_node_network_is_the_highest_free_one_and_the_worker_starts_on_it(
    runtime: DockerRuntime, docker_engine: DockerEngine
) -> None:
    """A gang member at the barrier is given its address before it starts (the others' MASTER_ADDR): the highest
    free one, clear of those held for others, of the gateway and of the workers on the network."""
    name = runtime.node_network("10.203.0.0/29")  # hosts .1 (the gateway) to .6
    try:
        assert runtime.hold_node_address(set()) == "10.203.0.6"
        assert runtime.hold_node_address({"10.203.0.6"}) == "10.203.0.5"
        k = key()
        runtime.start(k, sh("ip -4 -o addr show eth0; sleep 30", network=name, network_ip="10.203.0.5"))
        assert runtime.node_address(k) == "10.203.0.5"
        assert runtime.hold_node_address({"10.203.0.6"}) == "10.203.0.4"  # .5 is the worker's now
        with pytest.raises(NetworkNotUp) as full:
            runtime.hold_node_address({"10.203.0.2", "10.203.0.3", "10.203.0.4", "10.203.0.6"})
        assert str(full.value) == "every address of 10.203.0.0/29 is in use"
        runtime.stop(k, grace_seconds=0)
        runtime.delete(k)
    finally:
        with contextlib.suppress(RuntimeError):
            docker_engine.docker("network", "rm", name)
