"""A gang end to end on the embedded default's parts (dev server, control plane, scheduler, two agents as
processes): four workers across two machines run the all-reduce (`python3 -m allreduce`); none starts before every
member is set up, which the workers' own start times show; and a service with a readiness check and a group that
waits for it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.harness import Cluster
from workers.devserver import free_port

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("gang"))
    try:
        c.start(
            {"m0": ["--cpus", "2", "--memory-bytes", str(2**32)], "m1": ["--cpus", "2", "--memory-bytes", str(2**32)]}
        )
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, path: Path, spec: dict[str, Any]) -> None:
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def at(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(entry["at"]).timestamp()


def test_a_gang_across_two_machines_starts_together(cluster: Cluster, tmp_path: Path) -> None:
    starts = tmp_path / "starts.log"
    worker = {
        "command": ["python3", "-m", "allreduce"],
        "cpu": 1,
        "restart_policy": "Never",
        "env": {"ALLREDUCE_START_LOG": str(starts)},
    }
    # The last member needs a secret not synced to its machine yet: it keeps the gang at the barrier until then.
    late = worker | {"secrets": [{"name": "shard-key", "key": "token", "env": "SHARD_KEY"}]}
    spec = {
        "name": "allreduce",
        "gang": True,
        "groups": [worker | {"name": "w", "replicas": 3}, late | {"name": "late"}],
    }
    submit(cluster, tmp_path / "gang.yaml", spec)

    waiting = "waiting for external secret shard-key (key token) to be synced to this node"

    def three_ready_one_waiting(d: dict) -> bool:  # type: ignore[type-arg]
        late = next(t for t in d["tasks"] if t["id"] == "late-0")  # its machine reports the wait (Preparing)
        return bool(d["status"]["reason"] == "Starting together: 3 of 4 ready" and late["status"]["reason"] == waiting)

    described = cluster.wait_for(
        lambda: three_ready_one_waiting(d := cluster.describe("allreduce")) and d,
        "three members at the barrier, the last one waiting for its secret",
    )
    states = {t["id"]: t["status"]["state"] for t in described["tasks"]}
    assert states == {"w-0": "ReadyToStart", "w-1": "ReadyToStart", "w-2": "ReadyToStart", "late-0": "Preparing"}
    assert {t["node"] for t in described["tasks"]} == {"m0", "m1"}
    time.sleep(2)
    assert not starts.exists(), "no member's process starts while one is not ready"

    late_node = next(t["node"] for t in described["tasks"] if t["id"] == "late-0")
    late_task = next(t for t in described["tasks"] if t["id"] == "late-0")
    assert late_task["status"]["reason"] == (
        "waiting for external secret shard-key (key token) to be synced to this node"
    )
    secret = cluster.agent_dir(late_node) / "secrets" / "shard-key" / "token"
    secret.parent.mkdir(parents=True)
    opened = time.time()
    secret.write_text("s3cret")
    done = cluster.wait_state("allreduce", "Completed", "Failed", timeout=90)
    assert done["status"]["reason"] == "All workers completed"
    lines = [line.split() for line in starts.read_text().splitlines()]
    assert sorted(rank for rank, _ in lines) == ["0", "1", "2", "3"]
    last_ready = max(at(e) for t in done["tasks"] for e in t["history"] if e["state"] == "ReadyToStart")
    assert min(float(t) for _, t in lines) >= max(last_ready, opened) - 0.5  # clocks: the same machine

    history = cluster.cli("history", "allreduce").stdout
    climbing = [f"Starting together: {r} of 4 ready" for r in (0, 3, 4)]
    positions = [history.index(line) for line in climbing]
    assert positions == sorted(positions)
    assert "4 of 4 workers running" in history or "All workers completed" in history
    logs = cluster.cli("logs", "allreduce/w-1").stdout
    assert "rank 1/4: all-reduce ok: [10.0, 20.0, 30.0, 40.0]" in logs


def test_a_group_waits_for_a_healthy_service_group(cluster: Cluster, tmp_path: Path) -> None:
    port_file = tmp_path / "ready"
    server = {
        "name": "db",
        "command": ["sh", "-c", f"sleep 4; touch {port_file}; sleep 600"],
        "cpu": 0.5,
        "readiness": {"command": ["test", "-e", str(port_file)], "period_seconds": 0.5},
    }
    app = {
        "name": "app",
        "command": ["sleep", "600"],
        "cpu": 0.5,
        "depends_on": [{"group": "db", "condition": "healthy"}],
    }
    submit(cluster, tmp_path / "svc.yaml", {"name": "svc", "lifetime": "Service", "groups": [server, app]})
    waiting = cluster.wait_for(
        lambda: (d := cluster.describe("svc"))["status"]["state"] == "Running" and d, "the db to run"
    )
    app_task = next(t for t in waiting["tasks"] if t["id"] == "app-0")
    assert app_task["status"]["reason"] == "Waits for worker group db to be healthy"
    assert waiting["status"]["reason"] == "0 of 2 workers serving"
    serving = cluster.wait_for(
        lambda: (d := cluster.describe("svc"))["status"]["reason"] == "2 of 2 workers serving" and d,
        "both groups serving",
    )
    assert {t["id"]: t["healthy"] for t in serving["tasks"]} == {"db-0": True, "app-0": None}
    assert "(healthy)" in cluster.cli("describe", "svc").stdout
    app_history = [e["reason"] for t in serving["tasks"] if t["id"] == "app-0" for e in t["history"]]
    assert app_history[:3] == [
        "Waiting for workers to start",
        "Waits for worker group db to be healthy",
        "Waiting for workers to start",
    ]
    run_reasons = [e["reason"] for e in serving["history"]]
    assert run_reasons.index("0 of 2 workers serving") < run_reasons.index("1 of 2 workers serving")
    cluster.cli("cancel", "svc")
    cluster.wait_state("svc", "Cancelled")


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_the_examples_of_the_tour_run(cluster: Cluster, tmp_path: Path) -> None:
    cluster.cli("submit", str(EXAMPLES / "gang-allreduce.yaml"))
    cluster.cli("submit", str(EXAMPLES / "shards.yaml"))
    gang = cluster.wait_state("gang-allreduce", "Completed", "Failed", timeout=90)
    assert gang["status"]["reason"] == "All workers completed"
    assert "rank 2/4: all-reduce ok: [10.0, 20.0, 30.0, 40.0]" in cluster.cli("logs", "gang-allreduce/worker-2").stdout
    shards = cluster.wait_state("shards", "Completed", "Failed", timeout=90)
    assert shards["status"]["reason"] == "All workers completed"
    waited = {e["reason"] for t in shards["tasks"] for e in t["history"]}
    assert "Array runs at most 2 workers at once" in waited
    started = sorted((t["status"]["started_at"], t["status"]["finished_at"]) for t in shards["tasks"])
    assert all(sum(s <= at < f for s, f in started) <= 2 for at, _ in started)  # never more than 2 at once

    port = free_port()
    service = yaml.safe_load((EXAMPLES / "service.yaml").read_text().replace("8765", str(port)))
    submit(cluster, tmp_path / "service.yaml", service)
    serving = cluster.wait_for(
        lambda: (d := cluster.describe("service"))["status"]["reason"] == "2 of 2 workers serving" and d,
        "the service example to serve",
    )
    assert serving["status"]["state"] == "Running"
    cluster.cli("cancel", "service")
    cluster.wait_state("service", "Cancelled")


def test_a_gang_that_cannot_be_placed_whole_places_no_member(cluster: Cluster, tmp_path: Path) -> None:
    group = {"name": "w", "replicas": 3, "command": ["sleep", "600"], "cpu": 2}  # two machines of 2 cpus: 2 fit
    submit(cluster, tmp_path / "big.yaml", {"name": "too-wide", "gang": True, "groups": [group]})
    described = cluster.wait_for(
        lambda: (d := cluster.describe("too-wide"))["status"]["code"] == "GangCannotBePlaced" and d,
        "the gang to say it cannot be placed whole",
    )
    assert described["status"]["reason"] == "Gang cannot be placed whole: 2 of 2 machines ready"
    assert {(t["status"]["state"], t["node"]) for t in described["tasks"]} == {("Pending", None)}
    assert {t["status"]["reason"] for t in described["tasks"]} == {described["status"]["reason"]}
    # Why, machine by machine, for the member that did not fit once the first two had their places.
    assert described["placement"]["nodes"] == [
        {"name": "m0", "reasons": ["insufficient cpu: need 2 cores, 0 free"]},
        {"name": "m1", "reasons": ["insufficient cpu: need 2 cores, 0 free"]},
    ]
    cluster.cli("cancel", "too-wide")
    cluster.wait_state("too-wide", "Cancelled")
