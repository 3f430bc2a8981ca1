"""One scheduler, fenced, on a real cluster (dev server, control plane, agents and schedulers as processes, each
ended by its PID): two schedulers started together, and a rolling update. Exactly one holds the lease and places;
the other waits as a standby, its door refusing every call naming the holder and its epoch; no run is told "no
machines are registered" while the machines are Ready; a standby takes over within the lease's TTL once the holder
is stopped, rebuilds its view from the runs, and places."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.integration.harness import Cluster
from workers.devserver import free_port

pytestmark = pytest.mark.integration

TTL = 3.0  # the scheduler's lease, shrunk
AGENTS = {"g0": ["--gpus", "2xL4-24GB"], "g1": ["--gpus", "2xL4-24GB"]}
STANDBY = re.compile(r"^standby: scheduler (\S+) holds the lease \(epoch (\d+)\)$")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path, scheduler_lease_ttl_seconds=TTL)
    try:
        yield c
    finally:
        c.stop()


def door_of(cluster: Cluster, door: str) -> tuple[int, str, str]:
    """What a scheduler's door answers to GET /usage now: status, its epoch (a holder's), its error (a standby's)."""
    try:
        answer = httpx.get(f"http://{door}/usage", timeout=5)
    except httpx.HTTPError as error:
        return 0, "", repr(error)
    error = answer.json().get("error", "") if answer.status_code != 200 else ""
    return answer.status_code, answer.headers.get("x-astraeus-scheduler-epoch", ""), error


def submit(cluster: Cluster, tmp_path: Path, name: str) -> None:
    spec = {"name": name, "groups": [{"name": "w", "command": ["sleep", "600"], "gpus": 1, "cpu": 0.1}]}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def reasons(cluster: Cluster, run: str) -> list[str]:
    described = cluster.describe(run)
    return [e["reason"] for t in described["tasks"] for e in t["history"]] + [described["status"]["reason"]]


def test_two_schedulers_started_together_one_holds_the_lease_and_every_run_is_placed(
    cluster: Cluster, tmp_path: Path
) -> None:
    a, b = cluster.scheduler, f"127.0.0.1:{free_port()}"  # the control plane calls a
    cluster.server.start()
    cluster.spawn("control", "control")
    for name, agent_flags in AGENTS.items():
        cluster.spawn_agent(name, *agent_flags)
    cluster.spawn("sched-a", "scheduler", "--listen", a)
    cluster.spawn("sched-b", "scheduler", "--listen", b)
    cluster.wait_for(lambda: len(cluster.json("nodes")) == 2, "both machines registered")
    doors = cluster.wait_for(
        lambda: (
            (d := {door: door_of(cluster, door) for door in (a, b)})
            and sorted(s for s, _, _ in d.values()) == [200, 503]
            and d
        ),
        "one door to serve and the other to refuse",
    )
    holder = a if doors[a][0] == 200 else b
    standby = b if holder == a else a
    error = doors[standby][2]
    refused = STANDBY.match(error)
    assert refused is not None, error
    assert refused.group(2) == doors[holder][1]  # the standby names the holder's epoch
    for run in ("r0", "r1", "r2"):
        submit(cluster, tmp_path, run)
    if holder == b:  # the control plane calls the standby: its calls are tried again until a takes over
        time.sleep(2)
        assert all(cluster.describe(r)["status"]["state"] == "Pending" for r in ("r0", "r1", "r2"))
        cluster.kill("sched-b", signal.SIGTERM)
    for run in ("r0", "r1", "r2"):
        cluster.wait_state(run, "Running", timeout=60)
    for run in ("r0", "r1", "r2"):
        assert not [r for r in reasons(cluster, run) if "no machines are registered" in r]
    nodes = [t["node"] for r in ("r0", "r1", "r2") for t in cluster.describe(r)["tasks"]]
    assert sorted(nodes).count("g0") <= 2 and sorted(nodes).count("g1") <= 2  # never double-booked


def test_a_rolling_update_hands_the_lease_to_the_new_scheduler_within_its_ttl(cluster: Cluster, tmp_path: Path) -> None:
    old, new = cluster.scheduler, f"127.0.0.1:{free_port()}"
    cluster.start(AGENTS)  # the control plane and the old scheduler, on `old`
    cluster.wait_for(lambda: door_of(cluster, old)[0] == 200, "the old scheduler to serve")
    old_epoch = door_of(cluster, old)[1]
    submit(cluster, tmp_path, "before")
    cluster.wait_state("before", "Running")
    # The new scheduler starts beside the old one: a standby.
    cluster.spawn("sched-new", "scheduler", "--listen", new)
    standby = cluster.wait_for(lambda: (d := door_of(cluster, new))[0] == 503 and d, "the new one to be a standby")
    refused = STANDBY.match(standby[2])
    assert refused is not None and refused.group(2) == old_epoch, standby
    # The control plane is pointed at the new one: a run submitted now waits, its calls tried again.
    cluster.kill("control", signal.SIGTERM)
    cluster.spawn("control", "control", env={"ASTRAEUS_SCHEDULER": new})
    submit(cluster, tmp_path, "during")
    time.sleep(2)
    assert cluster.describe("during")["status"]["state"] == "Pending"
    # The old one is stopped by its PID: the new one takes over within the lease's TTL and places.
    cluster.kill("scheduler", signal.SIGTERM)
    stopped = time.monotonic()
    cluster.wait_for(lambda: door_of(cluster, new)[0] == 200, "the new scheduler to take over", timeout=2 * TTL + 10)
    took = time.monotonic() - stopped
    # within the lease's TTL of its last renewal, a standby's claim (a sixth of it) and a loaded machine's delays
    assert took < 2 * TTL + 3, f"took over {took:.1f} s after the old one stopped"
    assert int(door_of(cluster, new)[1]) > int(old_epoch)
    cluster.wait_state("during", "Running", timeout=60)
    submit(cluster, tmp_path, "after")
    cluster.wait_state("after", "Running", timeout=60)
    assert cluster.describe("before")["status"]["state"] == "Running"  # rebuilt from the runs, not placed again
    placed = [t["node"] for r in ("before", "during", "after") for t in cluster.describe(r)["tasks"]]
    assert sorted(placed).count("g0") <= 2 and sorted(placed).count("g1") <= 2
    log = (cluster.root / "sched-new.log").read_text()
    assert "waits as a standby" in log and f"epoch {int(old_epoch) + 1}: placed" in log
