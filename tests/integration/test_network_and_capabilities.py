"""What a worker asks of its machine, end to end on a real cluster (the dev server, a control plane, a scheduler
and agents as processes): machines report RDMA ports read from fake sysfs trees (`--sysfs`), runs ask for any RDMA
port, InfiniBand at a speed, or a fabric, and a gang stays on one fabric; runs require capabilities (an outbound
policy, a sandbox, a tool gateway, a model server) that machines have or say why not, and that machines set up or
fail with the spec's reason; a person's command in a worker behind an outbound policy is behind it too. Read back
through `astraeus describe --json` as a user reads it, whole sentences.
Sandboxed workers on a Docker engine with gVisor are in test_docker_capabilities.py."""

from __future__ import annotations

import http.server
import re
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.agent.capabilities import OUTBOUND_NEEDS
from activities.agent.runtime.process import PROCESS_SANDBOX
from tests.integration.harness import Cluster
from tests.integration.test_interactive import astraeus as attach_as_a_person

pytestmark = pytest.mark.integration

GIB = 2**30
MACHINE = ["--cpus", "2", "--memory-bytes", str(4 * GIB)]


def sysfs(root: Path, ports: dict[str, tuple[str, str, str]]) -> Path:
    """A fake /sys: for each `device/port`, its (state, rate, link layer) as the kernel writes them."""
    root.mkdir(parents=True)
    for name, (state, rate, link) in ports.items():
        device, port = name.split("/")
        path = root / "class" / "infiniband" / device / "ports" / port
        (path / "gids").mkdir(parents=True)
        (path / "state").write_text(f"{state}\n")
        (path / "rate").write_text(f"{rate}\n")
        (path / "link_layer").write_text(f"{link}\n")
        (path / "gids" / "0").write_text("fe80:0000:0000:0000:0002:c903:0031:7c71\n")
    return root


@pytest.fixture(scope="module")
def served() -> Iterator[ModelServer]:
    server = model_server()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, served: ModelServer) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("network")
    hdr = ("4: ACTIVE", "400 Gb/sec (4X NDR)", "InfiniBand")
    a = sysfs(root / "sys-a", {"mlx5_0/1": hdr})
    b = sysfs(
        root / "sys-b",
        {"mlx5_0/1": ("4: ACTIVE", "100 Gb/sec (4X EDR)", "InfiniBand"), "mlx5_1/1": (*hdr[:2], "Ethernet")},
    )
    down = sysfs(root / "sys-down", {"mlx5_0/1": ("1: DOWN", "400 Gb/sec (4X NDR)", "InfiniBand")})
    plain = sysfs(root / "sys-plain", {})
    c = Cluster(root)
    try:
        c.start(
            {
                "a0": [*MACHINE, "--sysfs", str(a), "--ib-fabric", "ib-0"],
                "a1": [*MACHINE, "--sysfs", str(a), "--ib-fabric", "ib-0"],
                "b0": [*MACHINE, "--sysfs", str(b), "--ib-fabric", "ib-1"],
                "down": [*MACHINE, "--sysfs", str(down)],
                "plain": [*MACHINE, "--sysfs", str(plain)],
                "served": [*MACHINE, "--sysfs", str(plain), "--tool-gateway", GATEWAY, "--model-server", served.url],
                "deaf": [*MACHINE, "--sysfs", str(plain), "--model-server", SILENT],
                "fw": [*MACHINE, "--sysfs", str(plain), "--outbound-policy"],
            }
        )
        yield c
    finally:
        c.stop()


GATEWAY = "http://gateway.internal:9000"
SILENT = "http://127.0.0.1:1/"  # nothing listens there


class ModelServer(http.server.ThreadingHTTPServer):
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"


def model_server() -> ModelServer:
    """An HTTP server that answers every GET: the model server one machine serves its workers (on loopback), and
    what a worker behind an outbound policy may or may not reach (at the machine's other addresses)."""
    server = ModelServer(("0.0.0.0", 0), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def submit(cluster: Cluster, tmp_path: Path, name: str, groups: list[dict[str, Any]], **fields: Any) -> None:
    spec = {"name": name, "groups": [{"cpu": 2, "command": ["true"], **g} for g in groups], **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def why_not(cluster: Cluster, run: str) -> tuple[str, dict[str, list[str]]]:
    """The run's reason once it explains its wait, and each machine's reasons, by machine."""
    described = cluster.wait_for(lambda: (d := cluster.describe(run))["placement"]["nodes"] and d, f"{run} to wait")
    return described["status"]["reason"], {n["name"]: n["reasons"] for n in described["placement"]["nodes"]}


def machines_of(described: dict[str, Any]) -> list[str]:
    return sorted(t["node"] for t in described["tasks"])


def test_a_run_asking_for_rdma_or_infiniband_hears_each_machine_s_ports(cluster: Cluster, tmp_path: Path) -> None:
    submit(
        cluster,
        tmp_path,
        "rdma",
        [{"name": "w", "network": {"rdma": True}}],
        node_selection={"names": ["down", "plain"]},
    )
    assert why_not(cluster, "rdma") == (
        "No machine fits: 8 of 8 machines ready",
        {
            "a0": ["machine is not among the selected names"],
            "a1": ["machine is not among the selected names"],
            "b0": ["machine is not among the selected names"],
            "down": ["no active RDMA port"],
            "plain": ["no active RDMA port"],
            "served": ["machine is not among the selected names", "no active RDMA port"],
            "deaf": ["machine is not among the selected names", "no active RDMA port"],
            "fw": ["machine is not among the selected names", "no active RDMA port"],
        },
    )
    cluster.cli("cancel", "rdma")

    submit(cluster, tmp_path, "fast", [{"name": "w", "network": {"infiniband_gbps": 800}}])
    assert why_not(cluster, "fast")[1] == {
        "a0": ["no active InfiniBand port at 800 Gb/s or faster (mlx5_0/1 active at 400 Gb/s)"],
        "a1": ["no active InfiniBand port at 800 Gb/s or faster (mlx5_0/1 active at 400 Gb/s)"],
        "b0": ["no active InfiniBand port at 800 Gb/s or faster (mlx5_0/1 active at 100 Gb/s)"],
        "down": ["no active InfiniBand port at 800 Gb/s or faster (mlx5_0/1 down at 400 Gb/s)"],
        "plain": ["no active InfiniBand port at 800 Gb/s or faster (no InfiniBand port)"],
        "served": ["no active InfiniBand port at 800 Gb/s or faster (no InfiniBand port)"],
        "deaf": ["no active InfiniBand port at 800 Gb/s or faster (no InfiniBand port)"],
        "fw": ["no active InfiniBand port at 800 Gb/s or faster (no InfiniBand port)"],
    }
    cluster.cli("cancel", "fast")

    submit(cluster, tmp_path, "roce", [{"name": "w", "network": {"rdma": True}}], node_selection={"names": ["b0"]})
    assert machines_of(cluster.wait_state("roce", "Completed")) == ["b0"]


def test_a_run_asking_for_a_fabric_goes_there(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "on-ib1", [{"name": "w", "network": {"fabric": "ib-1"}}])
    assert machines_of(cluster.wait_state("on-ib1", "Completed")) == ["b0"]

    submit(
        cluster, tmp_path, "on-ib9", [{"name": "w", "network": {"fabric": "ib-9"}}], node_selection={"names": ["a0"]}
    )
    assert why_not(cluster, "on-ib9")[1]["a0"] == [
        "no active InfiniBand port on fabric ib-9 (mlx5_0/1 active at 400 Gb/s on fabric ib-0)"
    ]
    cluster.cli("cancel", "on-ib9")


def test_a_gang_asking_for_infiniband_stays_on_one_fabric(cluster: Cluster, tmp_path: Path) -> None:
    # Each worker takes a whole machine (2 cpus): two fit on ib-0 together; three would need ib-1 too.
    submit(cluster, tmp_path, "pair", [{"name": "w", "replicas": 2, "network": {"infiniband_gbps": 100}}], gang=True)
    assert machines_of(cluster.wait_state("pair", "Completed")) == ["a0", "a1"]

    submit(cluster, tmp_path, "trio", [{"name": "w", "replicas": 3, "network": {"infiniband_gbps": 100}}], gang=True)
    reason, nodes = why_not(cluster, "trio")
    assert reason == "Gang cannot be placed whole: 8 of 8 machines ready"
    assert nodes["b0"] == [
        "no active InfiniBand port at 100 Gb/s or faster (mlx5_0/1 active at 100 Gb/s on fabric ib-1; its gang is on "
        "fabric ib-0)"
    ]
    cluster.cli("cancel", "trio")


# ---- capabilities ---------------------------------------------------------------------------------------------------


def test_a_run_requiring_what_no_machine_can_do_hears_each_machine_say_why(cluster: Cluster, tmp_path: Path) -> None:
    policy = {"outbound_policy": {"allow": ["10.0.0.0/8", "pypi.org"]}}
    submit(cluster, tmp_path, "egress", [{"name": "w", "capabilities": policy}], node_selection={"names": ["a0"]})
    assert why_not(cluster, "egress")[1]["a0"] == [f"machine cannot enforce an outbound policy ({OUTBOUND_NEEDS})"]
    cluster.cli("cancel", "egress")

    submit(cluster, tmp_path, "boxed", [{"name": "w", "capabilities": {"sandbox": True}}])
    reason, nodes = why_not(cluster, "boxed")
    assert reason == "No machine fits: 8 of 8 machines ready"
    assert nodes["plain"] == [f"machine cannot run sandboxed workers ({PROCESS_SANDBOX})"]
    cluster.cli("cancel", "boxed")

    submit(
        cluster,
        tmp_path,
        "tools",
        [{"name": "w", "capabilities": {"tool_gateway": True}}],
        node_selection={"names": ["a0", "served"]},
    )
    # The one machine with a gateway is busy (a worker holds its 2 cpus); a0 has none.
    assert machines_of(cluster.wait_state("tools", "Completed")) == ["served"]
    hold = [{"name": "w", "command": ["sleep", "600"], "capabilities": {"tool_gateway": True}}]
    submit(cluster, tmp_path, "tools-busy", hold)
    cluster.wait_state("tools-busy", "Running")
    submit(
        cluster,
        tmp_path,
        "tools-wait",
        [{"name": "w", "capabilities": {"tool_gateway": True}}],
        node_selection={"names": ["a0", "served"]},
    )
    nodes = why_not(cluster, "tools-wait")[1]
    assert (nodes["a0"], nodes["served"]) == (
        ["machine serves no tool gateway to its workers (its agent was started without --tool-gateway)"],
        ["insufficient cpu: need 2 cores, 0 free"],
    )
    cluster.cli("cancel", "tools-wait")
    cluster.cli("cancel", "tools-busy")


def test_a_worker_gets_its_machines_gateway_and_model_server(cluster: Cluster, tmp_path: Path) -> None:
    check = f'test "$ASTRAEUS_TOOL_GATEWAY" = {GATEWAY} && test -n "$ASTRAEUS_MODEL_SERVER"'
    wanted = {"tool_gateway": True, "model_server": True}
    submit(cluster, tmp_path, "served", [{"name": "w", "command": ["sh", "-c", check], "capabilities": wanted}])
    described = cluster.wait_state("served", "Completed", "Failed")
    assert (described["status"]["reason"], machines_of(described)) == ("All workers completed", ["served"])


def test_a_model_server_that_does_not_answer_fails_the_worker(cluster: Cluster, tmp_path: Path) -> None:
    group = {"name": "w", "restart_policy": "Never", "capabilities": {"model_server": True}}
    submit(cluster, tmp_path, "deaf", [group], node_selection={"names": ["deaf"]})
    described = cluster.wait_state("deaf", "Failed", "Completed")
    why = f"Model server: {SILENT} does not answer: [Errno 111] Connection refused"
    assert described["status"]["reason"] == f"Worker w-0 failed on deaf: {why}"

    submit(cluster, tmp_path, "unserved", [group], node_selection={"names": ["plain"]})
    described = cluster.wait_state("unserved", "Failed", "Completed")
    why = "Model server: this machine serves no model (its agent was started without --model-server)"
    assert described["status"]["reason"] == f"Worker w-0 failed on plain: {why}"


def machine_address() -> str:
    """This machine's first global IPv4 address: a worker in a namespace of its own reaches it over its veth."""
    shown = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True)
    addresses = [line.split()[3].split("/")[0] for line in shown.stdout.splitlines()]
    if not addresses:
        pytest.skip("this machine has no global IPv4 address for a worker behind an outbound policy to try")
    return addresses[0]


def test_a_worker_behind_an_outbound_policy_reaches_only_what_it_allows(
    cluster: Cluster, tmp_path: Path, served: ModelServer
) -> None:
    port = served.server_address[1]
    # Its namespace's gateway (the machine's end of its veth, in 169.254.0.0/16) is allowed, the machine's own
    # address is not: the first GET answers, the second is refused by the worker's firewall.
    fetch = "wget -q -T 3 -O /dev/null"
    script = (
        f"gw=$(ip route | awk '/default/ {{print $3}}'); {fetch} http://$gw:{port}/ && echo allowed; "
        f"{fetch} http://{machine_address()}:{port}/ || echo refused"
    )
    policy = {"outbound_policy": {"allow": ["169.254.0.0/16"]}}
    group = {"name": "w", "command": ["sh", "-c", script], "capabilities": policy}
    submit(cluster, tmp_path, "fenced", [group])
    described = cluster.wait_state("fenced", "Completed", "Failed")
    assert (described["status"]["reason"], machines_of(described)) == ("All workers completed", ["fw"])
    assert cluster.cli("logs", "fenced/w-0").stdout.splitlines()[0] == "allowed"
    assert cluster.cli("logs", "fenced/w-0").stdout.splitlines()[-1] == "refused"


def test_an_outbound_policy_that_cannot_be_set_up_fails_the_worker(cluster: Cluster, tmp_path: Path) -> None:
    policy = {"outbound_policy": {"allow": ["nowhere.invalid"]}}
    submit(cluster, tmp_path, "unfenced", [{"name": "w", "restart_policy": "Never", "capabilities": policy}])
    described = cluster.wait_state("unfenced", "Failed", "Completed")
    # The resolver's own words: "Name or service not known", or without a DNS server "Temporary failure ...".
    why = r"Outbound policy: host nowhere\.invalid does not resolve \(\[Errno -\d+\] [A-Za-z ]+\)"
    assert re.fullmatch(f"Worker w-0 failed on fw: {why}", described["status"]["reason"]), described["status"]


def test_a_person_s_command_runs_behind_the_worker_s_outbound_policy(
    cluster: Cluster, tmp_path: Path, served: ModelServer
) -> None:
    """`astraeus attach` runs in the worker's network namespace: what it may reach is what the worker may reach."""
    wanted = {"outbound_policy": {"allow": ["169.254.0.0/16"]}, "interactive_token": True}
    submit(cluster, tmp_path, "fenced-shell", [{"name": "w", "command": ["sleep", "300"], "capabilities": wanted}])
    described = cluster.wait_state("fenced-shell", "Running")
    assert machines_of(described) == ["fw"]
    fetch = f"wget -q -T 3 -O /dev/null http://{machine_address()}:{served.server_address[1]}/"
    outside = subprocess.run(["sh", "-c", f"{fetch} && echo allowed"], capture_output=True, text=True)
    assert outside.stdout == "allowed\n"  # the machine itself reaches it
    inside = attach_as_a_person(cluster, "attach", "fenced-shell/w-0", "--", "sh", "-c", f"{fetch} || echo refused")
    assert (inside.returncode, inside.stdout) == (0, "refused\n")
    cluster.cli("cancel", "fenced-shell")
