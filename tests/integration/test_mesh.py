"""The node network's mesh across machines, end to end on a real cluster: machine mesh-a is this host (the tests'
Docker engine); machine mesh-b is a network namespace joined to this host by a veth pair, with a Docker engine of its
own inside (keeping Docker's firewall there, as on a machine of its own); each agent joins the mesh with
--mesh-endpoint (mesh-b's with --mesh-netns), makes its WireGuard interface (the kernel's, else wireguard-go) and is
handed the other as its peer by the control plane. Workers on each machine's subnet then reach workers on the other's,
through the tunnel, unmasqueraded. A worker on mesh-b waits "Waiting for the node network (subnet assignment and
mesh)" while its machine's WireGuard cannot listen; mesh-c, whose agent joins no mesh, says why it takes no run that
may span machines."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from activities.agent import wireguard
from activities.agent.mesh import private_key, public_key
from tests.docker_engine import DockerEngine
from tests.integration.harness import Cluster
from tests.integration.test_identity import payloads
from workflows.contracts import SUBNETS_WORKFLOW_ID
from workflows.domain.mesh import interface_name

pytestmark = pytest.mark.integration

GIB = 2**30
RANGE = "10.238.0.0/16"  # no other test's: this test routes it on this host
HOST_END, NS_END = "10.239.255.1", "10.239.255.2"  # the veth pair between this host (mesh-a) and mesh-b
WAITING = "Waiting for the node network (subnet assignment and mesh)"
NOT_MESHED = (
    "machine cannot host the node network (its agent was started without --mesh-endpoint, so it is in no mesh "
    "between machines)"
)
# Serves its name, and a CGI script that answers the address the request came from; prints its own address.
SERVER = (
    "mkdir -p /www/cgi-bin && echo $ASTRAEUS_TASK > /www/name && "
    "printf '#!/bin/sh\\necho Content-Type: text/plain\\necho\\necho $REMOTE_ADDR\\n' > /www/cgi-bin/from && "
    "chmod +x /www/cgi-bin/from && ip -4 -o addr show eth0 && exec httpd -f -p 8080 -h /www"
)


def run(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True, timeout=30)


def udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def netns(docker_engine: DockerEngine) -> Iterator[str]:
    """Machine mesh-b's network: a namespace with a veth pair to this host."""
    why = wireguard.missing(None)
    if why is not None:
        pytest.skip(f"no WireGuard here: {why} (make test installs Debian's wireguard-go and wireguard-tools)")
    name, host_link, ns_link = f"astm-{os.getpid()}", f"amh{os.getpid()}"[:15], f"amn{os.getpid()}"[:15]
    run("ip", "netns", "add", name)
    try:
        run("ip", "link", "add", host_link, "type", "veth", "peer", "name", ns_link, "netns", name)
        run("ip", "addr", "add", f"{HOST_END}/30", "dev", host_link)
        run("ip", "link", "set", host_link, "up")
        for command in (("addr", "add", f"{NS_END}/30", "dev", ns_link), ("link", "set", ns_link, "up")):
            run("ip", "netns", "exec", name, "ip", *command)
        run("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)  # its end of the pair with it
        subprocess.run(["ip", "link", "del", host_link], check=False, capture_output=True)


@pytest.fixture(scope="module")
def engine_b(tmp_path_factory: pytest.TempPathFactory, netns: str) -> Iterator[DockerEngine]:
    engine = DockerEngine(tmp_path_factory.mktemp("docker-b"), netns=netns)
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def held_port(netns: str) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """mesh-b's WireGuard port, held by another process of its namespace until the test lets it go."""
    port = 51000 + os.getpid() % 1000
    holder = "import socket, sys, time; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    holder += "s.bind(('0.0.0.0', int(sys.argv[1]))); print('held', flush=True); time.sleep(600)"
    command = ["ip", "netns", "exec", netns, sys.executable, "-c", holder, str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None and process.stdout.readline() == b"held\n"
        yield port, process
    finally:
        release((port, process))


def release(held_port: tuple[int, subprocess.Popen[bytes]]) -> None:
    if held_port[1].poll() is None:
        held_port[1].send_signal(signal.SIGTERM)
        held_port[1].wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    docker_engine: DockerEngine,
    engine_b: DockerEngine,
    netns: str,
    held_port: tuple[int, subprocess.Popen[bytes]],
) -> Iterator[Cluster]:
    settings: dict[str, Any] = {"node_subnet_range": RANGE, "node_subnet_prefix": 24, "mesh_refresh_seconds": 1}
    c = Cluster(tmp_path_factory.mktemp("mesh"), **settings)
    room = ["--runtime", "docker", "--cpus", "4", "--memory-bytes", str(GIB)]
    machines = {
        "mesh-a": [*room, "--docker-host", docker_engine.host, "--mesh-endpoint", f"{HOST_END}:{udp_port()}"],
        "mesh-b": [
            *room, "--docker-host", engine_b.host, "--mesh-netns", netns, "--mesh-endpoint", f"{NS_END}:{held_port[0]}"
        ],
        "mesh-c": [*room, "--docker-host", docker_engine.host],
    }  # fmt: skip
    try:
        c.start(machines)
        yield c
    finally:
        c.stop()
        for machine, netns_of in (("mesh-a", None), ("mesh-b", netns)):
            # The agents left the mesh as they stopped; should one have been killed, its interface goes here.
            wireguard.Link(interface_name(machine), netns_of, c.agent_dir(machine) / "mesh").down()
        leftover = subprocess.run(["iptables-save"], capture_output=True, text=True, check=False).stdout
        assert f"astraeus mesh {interface_name('mesh-a')}" not in leftover  # mesh-a's agent removed its rules
        for machine in ("mesh-a", "mesh-c"):  # this engine's: its workers, then its network
            containers = docker_engine.docker("ps", "-aq", "--filter", f"label=astraeus.node={machine}").split()
            if containers:
                docker_engine.docker("rm", "-f", *containers)
            with contextlib.suppress(RuntimeError):  # gone already
                docker_engine.docker("network", "rm", f"astraeus-node-{machine}")


def submit(cluster: Cluster, tmp_path: Path, name: str, groups: list[dict[str, Any]], **spec: Any) -> None:
    groups = [{"restart_policy": "Never", "cpu": 0.5, "image": "local/busybox:latest", "network": {"mesh": True}} | g
              for g in groups]  # fmt: skip
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"name": name, "groups": groups, **spec}))
    cluster.cli("submit", str(path))


def on(machine: str) -> dict[str, Any]:
    return {"node_selection": {"names": [machine]}}


def address(cluster: Cluster, worker: str) -> str:
    """A worker's address on its machine's subnet, as it printed it."""
    logged = cluster.wait_for(lambda: "inet " in (out := cluster.cli("logs", worker).stdout) and out, worker)
    found = re.search(r"inet (10\.238\.\d+\.\d+)/24", logged)
    assert found is not None, logged
    return found.group(1)


def test_a_machine_in_no_mesh_takes_no_run_that_may_span_machines(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "spread", [{"name": "w", "replicas": 2, "command": ["true"]}], **on("mesh-c"))
    described = cluster.wait_for(lambda: (d := cluster.describe("spread"))["placement"]["nodes"] and d, "why")
    assert [n["reasons"] for n in described["placement"]["nodes"] if n["name"] == "mesh-c"] == [[NOT_MESHED]]
    cluster.cli("cancel", "spread")


def test_workers_on_two_machines_reach_each_other_through_the_mesh(
    cluster: Cluster, tmp_path: Path, held_port: tuple[int, subprocess.Popen[bytes]]
) -> None:
    servers = [{"name": "sa", "command": ["sh", "-c", SERVER], **on("mesh-a")}]
    servers += [{"name": "sb", "command": ["sh", "-c", SERVER], **on("mesh-b")}]
    submit(cluster, tmp_path, "servers", servers)
    # mesh-b's WireGuard cannot listen (its port is held): its worker waits for the node network.
    waiting = cluster.wait_for(
        lambda: (d := cluster.describe("servers"))["tasks"][0]["status"]["state"] == "Running" and d, "sa to run"
    )
    assert (waiting["tasks"][1]["id"], waiting["tasks"][1]["status"]["reason"]) == ("sb-0", WAITING)

    release(held_port)  # the port is free: mesh-b joins the mesh at its next look
    cluster.wait_for(lambda: cluster.describe("servers")["tasks"][1]["status"]["state"] == "Running", "sb to run")
    sa, sb = address(cluster, "servers/sa-0"), address(cluster, "servers/sb-0")
    assert sa.rsplit(".", 1)[0] != sb.rsplit(".", 1)[0]  # two machines, two subnets
    described = cluster.describe("servers")  # where the run's workers reach each: shown by describe
    assert [(t["id"], t["node"], t["node_address"]) for t in described["tasks"]] == [
        ("sa-0", "mesh-a", sa),
        ("sb-0", "mesh-b", sb),
    ]
    assert f"Node address of sa-0: {sa}\n" in cluster.cli("describe", "servers").stdout

    # (busybox's wget -T crashes on a refused connection: `timeout` bounds it instead)
    fetch = "timeout 3 wget -q -O - http://{0}:8080/name && timeout 3 wget -q -O - http://{0}:8080/cgi-bin/from"
    client = "ip -4 -o addr show eth0; for i in $(seq 30); do " + fetch + " && exit 0; sleep 1; done; exit 1"
    clients = [{"name": "ca", "command": ["sh", "-c", client.format(sb)], **on("mesh-a")}]
    clients += [{"name": "cb", "command": ["sh", "-c", client.format(sa)], **on("mesh-b")}]
    submit(cluster, tmp_path, "clients", clients)
    ended = cluster.wait_state("clients", "Completed", "Failed")
    logged = {w: cluster.cli("logs", f"clients/{w}").stdout for w in ("ca-0", "cb-0")}
    assert ended["status"]["state"] == "Completed", (ended["status"], logged)
    for worker, server in (("clients/ca-0", "sb-0"), ("clients/cb-0", "sa-0")):
        # The server's name, and the client's own address as the server saw it (httpd writes an IPv4 address as
        # IPv6 maps it): not masqueraded on the way.
        *_, name, seen = cluster.cli("logs", worker).stdout.splitlines()
        assert (name, seen.removeprefix("[::ffff:").removesuffix("]")) == (server, address(cluster, worker))
    cluster.cli("cancel", "servers")
    cluster.wait_state("servers", "Cancelled")


def test_a_gang_on_two_machines_meets_at_the_leaders_address_on_the_node_network(
    cluster: Cluster, tmp_path: Path, held_port: tuple[int, subprocess.Popen[bytes]]
) -> None:
    """A gang's members meet at MASTER_ADDR:MASTER_PORT: on the node network, the address the leader's machine held
    for it at the barrier, before it started, which the follower on the other machine reaches through the mesh."""
    release(held_port)  # let go by the test before, unless this one runs alone
    leader = SERVER.replace("-p 8080", "-p $MASTER_PORT")
    fetch = "timeout 3 wget -q -O - http://$MASTER_ADDR:$MASTER_PORT/name"
    follower = "echo master $MASTER_ADDR; for i in $(seq 30); do " + fetch + " && exit 0; sleep 1; done; exit 1"
    groups = [{"name": "lead", "command": ["sh", "-c", leader], **on("mesh-a")}]
    groups += [{"name": "follow", "command": ["sh", "-c", follower], **on("mesh-b")}]
    submit(cluster, tmp_path, "gang", groups, gang=True)
    cluster.wait_for(lambda: "lead-0" in cluster.cli("logs", "gang/follow-0").stdout, "the follower to reach it")
    # Its tries are refused until the leader listens. Their errors go to stderr, which Docker reads apart from stdout:
    # the first of them may be logged before the echo that came first.
    logged = cluster.cli("logs", "gang/follow-0").stdout.splitlines()
    lead = address(cluster, "gang/lead-0")
    assert ([line for line in logged if line.startswith("master ")], logged[-1]) == ([f"master {lead}"], "lead-0")
    assert lead.startswith("10.238.") and lead.endswith(".254")  # held at the barrier: its subnet's highest free one
    cluster.cli("cancel", "gang")
    cluster.wait_state("gang", "Cancelled", "Completed", "Failed")


def test_a_machines_private_key_stays_on_it_and_its_public_key_reaches_the_control_plane(cluster: Cluster) -> None:
    async def history() -> str:
        client = await Client.connect(cluster.address, data_converter=pydantic_data_converter)
        return (await client.get_workflow_handle(SUBNETS_WORKFLOW_ID).fetch_history()).to_json()

    searched = payloads(asyncio.run(history()))
    for machine in ("mesh-a", "mesh-b"):
        kept = cluster.agent_dir(machine) / "mesh" / "private.key"
        assert kept.stat().st_mode & 0o777 == 0o600
        key = private_key(kept)
        assert base64.b64encode(key.private_bytes_raw()) not in searched
        assert public_key(key).encode() in searched
