"""Astraeus's metrics from the scheduler's view, and which exporters a process's telemetry sets up."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from prometheus_client import REGISTRY

from activities.metrics import SCHEDULER, SchedulerFigures, figures, observe_pass
from tests.domain.builders import T0, holding, machine, request
from workers.telemetry import tracer_provider, tracing
from workflows.domain.scheduling.plans import Decision, Plan, Preemption

ASTRAEUS = str(Path(sys.executable).parent / "astraeus")


def test_runs_workers_and_gpus_are_counted_from_the_view() -> None:
    requests = [request("w-1", run="half", gpus=1), request("w-0", run="queued", namespace="research", gpus=4)]
    allocations = [
        holding("m0", run="half", task="w-0", gpus=1),
        holding("m0", run="whole", gpus=2),
        holding("m1", run="whole", task="x-1", gpus=1),
    ]
    nodes = [machine("m0", gpus=4), machine("m1", gpus=2), machine("m2", gpus=0)]
    assert figures(requests, allocations, nodes) == SchedulerFigures(
        runs={("default", "waiting"): 1, ("research", "waiting"): 1, ("default", "placed"): 1},
        workers={("default", "waiting"): 1, ("research", "waiting"): 1, ("default", "placed"): 3},
        gpus={("m0", "used"): 3, ("m0", "free"): 1, ("m1", "used"): 1, ("m1", "free"): 1, ("m2", "used"): 0,
              ("m2", "free"): 0},
    )  # fmt: skip


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_pass_counts_its_decisions_its_waits_restarts_and_preemptions() -> None:
    first, again = request("w-0", run="m-a"), request("w-1", run="m-a").model_copy(update={"attempt": 2})
    waiting = request("w-0", run="m-b", namespace="metrics-test")
    plan = Plan(
        decisions=[Decision(first, "m0"), Decision(again, "m0"), Decision(waiting, None)],
        preemptions=[Preemption(job_id="job/metrics-test/low", task_ids=("w-0", "w-1"), by="m-a", head=("x", "y"))],
    )
    before = {
        "placed": sample("astraeus_placement_decisions_total", outcome="placed"),
        "waiting": sample("astraeus_placement_decisions_total", outcome="waiting"),
        "restarts": sample("astraeus_worker_restarts_total", namespace="default"),
        "waits": sample("astraeus_pending_to_placed_seconds_sum", namespace="default"),
        "preempted": sample("astraeus_preemptions_total", namespace="metrics-test"),
    }
    observe_pass(plan, T0 + timedelta(seconds=7))
    assert sample("astraeus_placement_decisions_total", outcome="placed") - before["placed"] == 2
    assert sample("astraeus_placement_decisions_total", outcome="waiting") - before["waiting"] == 1
    assert sample("astraeus_worker_restarts_total", namespace="default") - before["restarts"] == 1
    assert sample("astraeus_pending_to_placed_seconds_sum", namespace="default") - before["waits"] == 7
    assert sample("astraeus_preemptions_total", namespace="metrics-test") - before["preempted"] == 2


def test_the_views_gauges_are_counted_when_scraped() -> None:
    waiting = [request("w-0", run="m-b", namespace="metrics-scraped")]
    SCHEDULER.watch(lambda: (waiting, [], [machine("m0", gpus=1)]))
    assert sample("astraeus_runs", namespace="metrics-scraped", state="waiting") == 1
    waiting.append(request("w-0", run="m-c", namespace="metrics-scraped"))
    assert sample("astraeus_runs", namespace="metrics-scraped", state="waiting") == 2
    SCHEDULER.watch(lambda: ([], [], []))
    assert sample("astraeus_runs", namespace="metrics-scraped", state="waiting") == 0


def test_no_traces_are_exported_unless_asked() -> None:
    assert tracer_provider("control", {}) is None
    assert tracing(None) == []


def test_traces_go_by_otlp_when_an_endpoint_is_set() -> None:
    provider = tracer_provider("agent", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"})
    assert provider is not None
    assert provider.resource.attributes["service.name"] == "astraeus-agent"
    assert len(tracing(provider)) == 1
    provider.shutdown()


def test_a_metrics_address_that_is_not_host_port_exits_2() -> None:
    result = subprocess.run([ASTRAEUS, "scheduler", "--metrics", "9464"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (
        2,
        "astraeus: --metrics 9464: expected HOST:PORT, e.g. 0.0.0.0:9464\n",
    )
