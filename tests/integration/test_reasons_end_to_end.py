"""Reasons that only pure tests reached, reached end to end: a real cluster (the dev server, a control plane, a
scheduler and agents as processes, workers as real local processes), read back through `astraeus describe
--json` as a user reads them. Machines lost or removed under their workers, a gang that fails while Starting, the
CLI's Restarting, and every per-machine reason of placement.nodes that needs no hardware we lack."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.integration.harness import Cluster, pairs
from workers.render import _when
from workflows.contracts import CONTROL_TASK_QUEUE, node_id
from workflows.domain.settings import Settings
from workflows.messages import NodeInput
from workflows.node import NodeWorkflow

pytestmark = pytest.mark.integration

GIB = 2**30
MACHINE = ["--cpus", "4", "--memory-bytes", str(4 * GIB)]
DOWN = "machine is not ready (Down)"
# A worker that outlives a stop's signal: only the kill after the grace ends it, so it stays Stopping meanwhile.
STUBBORN = ["sh", "-c", "trap '' TERM; while true; do sleep 1; done"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, fake_nvml: Path) -> Iterator[Cluster]:
    # A long stop grace keeps a stubborn worker Stopping while its machine goes; a long back-off keeps a failed
    # worker Restarting while the CLI is asked.
    c = Cluster(
        tmp_path_factory.mktemp("reasons"), stop_grace_seconds=60, backoff_base_seconds=60, backoff_cap_seconds=60
    )
    try:
        c.start(
            {
                "m1": [*MACHINE, "--rack", "r1", "--label", "zone=a"],
                "m2": [*MACHINE, "--rack", "r2", "--label", "zone=a", "--pool", "p"],
                "m3": [*MACHINE, "--accept-label", "team=ml"],
                "gone": MACHINE,
            }
        )
        # Four H100s read through NVML (a fake libnvidia-ml), GPU 2 with retired pages pending: at risk.
        nvml = {"LD_LIBRARY_PATH": str(fake_nvml), "FAKE_NVML_COUNT": "4", "FAKE_NVML_PAGES_PENDING": "2"}
        c.spawn_agent("gpu", *MACHINE, env=nvml)
        c.wait_for(lambda: len(c.json("nodes")) == 5, "the GPU machine to register")
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, groups: list[dict[str, Any]], **fields: Any) -> None:
    spec = {"name": name, "groups": [{"cpu": 0.5, "command": ["sleep", "600"], **g} for g in groups], **fields}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def task(described: dict[str, Any], task_id: str) -> dict[str, Any]:
    return next(t for t in described["tasks"] if t["id"] == task_id)


def task_state(cluster: Cluster, run: str, task_id: str, *states: str) -> dict[str, Any]:
    return cluster.wait_for(  # type: ignore[no-any-return]
        lambda: (d := cluster.describe(run)) and task(d, task_id)["status"]["state"] in states and d,
        f"{run}/{task_id} to be {states}",
    )


def why_not(cluster: Cluster, run: str) -> dict[str, list[str]]:
    """placement.nodes once the run explains its wait: each machine's reasons, by machine."""
    described = cluster.wait_for(lambda: (d := cluster.describe(run))["placement"]["nodes"] and d, f"{run} to wait")
    return {n["name"]: n["reasons"] for n in described["placement"]["nodes"]}


def cancel(cluster: Cluster, run: str) -> None:
    cluster.cli("cancel", run)
    cluster.wait_state(run, "Cancelled", "Failed", "Completed")


# ---- machines that go while their workers run or stop ------------------------------------------------------------


def test_a_machine_lost_while_its_worker_stops_ends_it_cancelled(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "lost-stop", [{"name": "w", "command": STUBBORN}], node_selection={"names": ["gone"]})
    cluster.wait_state("lost-stop", "Running")
    cluster.cli("stop", "lost-stop/w-0", "--reason", "Making room")
    task_state(cluster, "lost-stop", "w-0", "Stopping")  # its machine sends TERM, which it ignores: 60 s of grace

    cluster.kill("gone")  # the agent dies mid-stop; its lease expires 5 s later

    described = task_state(cluster, "lost-stop", "w-0", "Cancelled")
    assert pairs(task(described, "w-0")["history"])[-2:] == [
        ("Stopping", "Making room"),
        ("Cancelled", "Machine lost while stopping"),
    ]
    described = cluster.wait_state("lost-stop", "Cancelled", "Failed")
    assert (described["status"]["state"], described["status"]["reason"]) == (
        "Cancelled",
        "All workers ended; some were cancelled",
    )
    gone = next(n for n in cluster.json("nodes") if n["name"] == "gone")
    assert (gone["state"], gone["history"][-1]["reason"]) == ("Down", "Machine lost: its lease expired")


def test_a_removed_machine_takes_its_workers_down_and_ends_a_stopping_one_cancelled(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.spawn_agent("doomed", *MACHINE)
    cluster.wait_for(lambda: any(n["name"] == "doomed" for n in cluster.json("nodes")), "doomed to register")
    groups = [{"name": "a", "restart_policy": "Never"}, {"name": "b", "command": STUBBORN}]
    submit(cluster, tmp_path, "removed", groups, node_selection={"names": ["doomed"]})
    cluster.wait_state("removed", "Running")
    cluster.cli("stop", "removed/b-0", "--reason", "Making room")
    task_state(cluster, "removed", "b-0", "Stopping")  # its machine sends TERM, which it ignores: 60 s of grace

    cluster.cli("nodes", "remove", "doomed", "--reason", "decommissioned")

    described = cluster.wait_state("removed", "Failed", "Cancelled", "Completed")
    assert pairs(task(described, "a-0")["history"])[-2:] == [
        ("Running", "Container running"),
        ("Down", "Machine removed from the cluster"),
    ]
    assert pairs(task(described, "b-0")["history"])[-2:] == [
        ("Stopping", "Making room"),
        ("Cancelled", "Machine removed from the cluster while stopping"),
    ]
    assert described["status"]["reason"] == "Worker a-0 was lost on doomed: Machine removed from the cluster"
    cluster.kill("doomed")  # removed, its agent still holds the lease: end it (and, with the cluster, its workers)


# ---- a gang that fails while Starting ------------------------------------------------------------------------------


def test_a_gang_member_that_cannot_be_set_up_fails_the_starting_gang(cluster: Cluster, tmp_path: Path) -> None:
    groups = [
        {"name": "a", "restart_policy": "Never"},
        # The process runtime mounts nothing: this member is refused at set-up, before the barrier.
        {
            "name": "b",
            "restart_policy": "Never",
            "drives": [{"name": "scratch", "volume": "scratch", "mount_path": "/data"}],
        },
    ]
    submit(cluster, tmp_path, "gang-fails", groups, gang=True, node_selection={"names": ["m1"]})

    described = cluster.wait_state("gang-fails", "Failed", "Completed", "Cancelled")

    refused = "Invalid task: the process runtime cannot mount drives or files (/data); run it on a docker machine"
    starting, failed = pairs(described["history"])[-2:]
    # a-0 may or may not have reached the barrier when b-0 was refused
    assert starting in [("Starting", f"Starting together: {r} of 2 ready") for r in (0, 1)]
    assert failed == ("Failed", f"Worker b-0 failed on m1: {refused}; the gang does not run without it")
    assert pairs(task(described, "b-0")["history"])[-1] == ("Failed", refused)


# ---- the CLI's Restarting ---------------------------------------------------------------------------------------


def test_a_worker_waiting_out_its_back_off_shows_restarting(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "flaky", [{"name": "w", "command": ["sh", "-c", "exit 3"]}])
    described = cluster.wait_for(
        lambda: (d := cluster.describe("flaky"))["tasks"][0]["restart_at"] and d, "flaky to wait out its back-off"
    )
    worker = described["tasks"][0]
    assert (worker["status"]["state"], worker["status"]["reason"]) == ("Failed", "Exited with code 3")

    human = cluster.cli("describe", "flaky", "--utc").stdout

    restart_at = _when(datetime.fromisoformat(worker["restart_at"]), utc=True)
    row = next(line for line in human.splitlines() if line.startswith("w-0 "))
    assert row.split() == [
        "w-0",
        "Restarting",
        worker["node"],
        "0",
        *f"Exited with code 3 (restarts at {restart_at})".split(),
    ]
    cancel(cluster, "flaky")


# ---- per-machine reasons ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gone_is_down(cluster: Cluster) -> None:
    """The machine `gone` is Down (its agent killed, its lease expired), as the first test leaves it."""
    if "gone" in cluster.processes:
        cluster.kill("gone")
    cluster.wait_for(
        lambda: next(n for n in cluster.json("nodes") if n["name"] == "gone")["state"] == "Down", "gone to be Down"
    )


def test_selection_memory_and_accepted_labels_say_why_each_machine_is_out(
    cluster: Cluster, tmp_path: Path, gone_is_down: None
) -> None:
    selection = {"names": ["m2"], "labels": {"zone": "a"}, "pools": ["p"]}
    submit(cluster, tmp_path, "picky", [{"name": "w", "memory_bytes": 6 * GIB}], node_selection=selection)

    memory = f"insufficient memory: need {6 * GIB} bytes, {4 * GIB} free"
    not_named = "machine is not among the selected names"
    no_pool = "machine lacks label pool.astraeus.io/name=p"
    assert why_not(cluster, "picky") == {
        "gone": [DOWN],
        "gpu": [not_named, "machine lacks label zone=a", memory],
        "m1": [not_named, no_pool, memory],
        "m2": [memory],
        "m3": [
            "worker carries none of the labels this machine accepts",
            not_named,
            "machine lacks label zone=a",
            memory,
        ],
    }
    cancel(cluster, "picky")


def test_healthy_only_counts_gpus_at_risk_apart(cluster: Cluster, tmp_path: Path, gone_is_down: None) -> None:
    submit(cluster, tmp_path, "healthy", [{"name": "w", "gpus": 4, "healthy_only": True}])

    no_gpus = "insufficient gpus: need 4, 0 free and usable"
    assert why_not(cluster, "healthy") == {
        "gone": [DOWN],
        "gpu": ["needs 4 healthy GPUs, 3 free (1 more free but at risk)"],
        "m1": [no_gpus],
        "m2": [no_gpus],
        "m3": ["worker carries none of the labels this machine accepts", no_gpus],
    }
    cancel(cluster, "healthy")


ZONE_A = {"labels": {"zone": "a"}}  # m1 and m2; w-0 takes m1 (the names break the tie)
ONLY_M1 = {"names": ["m1"]}
TOPOLOGY = [
    # (topology, cpu per worker, selection, the machine w-1 would fit but for the rule, and what it says)
    pytest.param(
        {"one_per_machine": True},
        0.5,
        ONLY_M1,
        "m1",
        "another worker of this run is already on the machine",
        id="one-per-machine",
    ),
    pytest.param({"one_machine": True}, 3, ZONE_A, "m2", "the run is kept on one machine, m1", id="one-machine"),
    pytest.param({"same_rack": True}, 3, ZONE_A, "m2", "the run is kept within rack r1", id="same-rack"),
    pytest.param({"max_machines": 1}, 3, ZONE_A, "m2", "the run may use at most 1 machines", id="max-machines"),
    pytest.param(
        {"one_per_rack": True}, 0.5, ONLY_M1, "m1", "rack r1 already has a worker of this run", id="one-per-rack"
    ),
]


@pytest.mark.parametrize(("topology", "cpu", "selection", "machine", "reason"), TOPOLOGY)
def test_topology_rules_say_why_the_second_worker_waits(
    cluster: Cluster,
    tmp_path: Path,
    gone_is_down: None,
    topology: dict[str, Any],
    cpu: float,
    selection: dict[str, Any],
    machine: str,
    reason: str,
) -> None:
    name = "topo-" + next(iter(topology)).replace("_", "-")
    groups = [{"name": "w", "replicas": 2, "cpu": cpu}]
    submit(cluster, tmp_path, name, groups, topology=topology, node_selection=selection)

    reasons = why_not(cluster, name)

    assert task(cluster.describe(name), "w-0")["node"] == "m1"
    assert reasons[machine] == [reason]
    if machine == "m2":  # w-1 does not fit beside w-0 on m1
        assert reasons["m1"] == ["insufficient cpu: need 3 cores, 1 free"]
    if topology.get("same_rack"):
        assert reasons["m3"][-1] == reasons["gpu"][-1] == "no rack set on this machine (topology.astraeus.io/rack)"
    cancel(cluster, name)


# ---- a machine whose agent never reported ---------------------------------------------------------------------------


def test_a_machine_whose_agent_never_registered_reports_no_capacity(cluster: Cluster, tmp_path: Path) -> None:
    # An agent's first step is to start its machine's workflow; this one died before registering.
    async def start_machine() -> None:
        client = await Client.connect(cluster.address, data_converter=pydantic_data_converter)
        await client.start_workflow(
            NodeWorkflow.run,
            NodeInput(name="silent", settings=Settings()),
            id=node_id("silent"),
            task_queue=CONTROL_TASK_QUEUE,
        )

    asyncio.run(start_machine())
    cluster.kill("scheduler", signal.SIGKILL)  # a scheduler that starts reads every machine's workflow
    cluster.spawn("scheduler", "scheduler")
    submit(cluster, tmp_path, "unheard", [{"name": "w", "gpus": 64}])

    assert why_not(cluster, "unheard")["silent"] == ["machine is not ready (no capacity reported)"]
    cancel(cluster, "unheard")
