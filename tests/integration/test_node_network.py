"""The node network, end to end on a real cluster (dev server, control plane, scheduler, agents as processes): a
docker machine is given a subnet of the cluster's range by the control plane and makes its network with it; a
worker that asks for the mesh waits "Waiting for the node network (subnet assignment and mesh)" until that network
is up, then has an address on the subnet and reaches the run's other worker by its name; a process machine says
it cannot host the node network; removing a machine frees its subnet."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.docker_engine import DockerEngine
from tests.integration.harness import Cluster
from workflows import contracts
from workflows.contracts import SUBNETS_WORKFLOW_ID

pytestmark = pytest.mark.integration

GIB = 2**30
RANGE = "10.201.0.0/24"  # one subnet: the whole range, so that the engine network below can stand in its way
BLOCKER = "someone-elses-network"
WAITING = "Waiting for the node network (subnet assignment and mesh)"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, docker_engine: DockerEngine) -> Iterator[Cluster]:
    # Another network of the engine holds the range: the machine cannot make its network until it is gone.
    docker_engine.docker("network", "create", "--subnet", RANGE, BLOCKER)
    settings: dict[str, Any] = {"node_subnet_range": RANGE, "node_subnet_prefix": 24}
    c = Cluster(tmp_path_factory.mktemp("node-network"), **settings)
    docker = ["--runtime", "docker", "--docker-host", docker_engine.host, "--cpus", "4", "--memory-bytes", str(GIB)]
    try:
        c.start({"d0": docker, "p0": ["--cpus", "4", "--memory-bytes", str(GIB)]})
        yield c
    finally:
        c.stop()
        for network in (BLOCKER, "astraeus-node-d0"):
            with contextlib.suppress(RuntimeError):  # gone already
                docker_engine.docker("network", "rm", network)


def submit(cluster: Cluster, tmp_path: Path, name: str, node: str, groups: list[dict[str, Any]]) -> None:
    spec = {
        "name": name,
        "topology": {"one_machine": True},
        "node_selection": {"names": [node]},
        "groups": [{"restart_policy": "Never", "cpu": 0.5, "network": {"mesh": True}, **g} for g in groups],
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def test_a_process_machine_says_it_cannot_host_the_node_network(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "on-p0", "p0", [{"name": "w", "command": ["true"]}])
    described = cluster.wait_for(lambda: (d := cluster.describe("on-p0"))["placement"]["nodes"] and d, "to say why")
    [p0] = [n for n in described["placement"]["nodes"] if n["name"] == "p0"]
    assert p0["reasons"] == [
        "machine cannot host the node network (its workers run as processes on the machine's own network; the node "
        "network needs the docker runtime, whose workers join a network with the machine's subnet)"
    ]
    cluster.cli("cancel", "on-p0")


def test_mesh_workers_wait_for_their_machines_network_then_reach_each_other_on_its_subnet(
    cluster: Cluster, docker_engine: DockerEngine
) -> None:
    cluster.cli("submit", "examples/mesh.yaml")  # only d0 hosts the node network: it goes there
    waiting = cluster.wait_for(
        lambda: (d := cluster.describe("mesh"))["tasks"][1]["status"]["state"] == "Preparing" and d, "mesh to wait"
    )
    assert [(t["id"], t["status"]["state"], t["status"]["reason"]) for t in waiting["tasks"]] == [
        ("server-0", "Preparing", WAITING),
        ("client-0", "Preparing", WAITING),
    ]
    assert waiting["status"]["reason"] == WAITING

    docker_engine.docker("network", "rm", BLOCKER)  # the machine makes its network at its next look
    cluster.wait_for(lambda: cluster.describe("mesh")["tasks"][1]["status"]["state"] == "Completed", "the ping")
    network = json.loads(docker_engine.docker("network", "inspect", "astraeus-node-d0"))[0]
    assert network["IPAM"]["Config"][0]["Subnet"] == RANGE
    logged = cluster.cli("logs", "mesh/server-0").stdout
    assert f"{RANGE} server-0.mesh.default\n" in logged
    assert "inet 10.201.0." in logged
    cluster.cli("cancel", "mesh")
    cluster.wait_state("mesh", "Cancelled", "Completed", "Failed")


def test_removing_a_machine_frees_its_subnet(cluster: Cluster) -> None:
    cluster.wait_for(lambda: subnets(cluster) == [{"node": "d0", "subnet": RANGE, "why": None}], "d0's subnet")
    cluster.cli("nodes", "remove", "d0", "--reason", "leaves")
    assert subnets(cluster) == []


def subnets(cluster: Cluster) -> list[dict[str, Any]]:
    """What the subnets workflow holds (its query)."""

    async def ask() -> list[dict[str, Any]]:
        client = await Client.connect(cluster.address, data_converter=pydantic_data_converter)
        held = await contracts.query(client.get_workflow_handle(SUBNETS_WORKFLOW_ID), contracts.SUBNETS)
        return [s.model_dump() for s in held]

    return asyncio.run(ask())
