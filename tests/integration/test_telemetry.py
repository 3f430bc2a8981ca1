"""Telemetry of real processes: the scheduler's and an agent's Prometheus endpoints (`--metrics`), their figures
moving with a run; and one trace following a run from submit to its worker's start on the agent."""

from __future__ import annotations

import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import Cluster
from workers.client import AstraeusClient
from workers.devserver import free_port
from workers.embedded import Embedded
from workers.telemetry import Telemetry, tracing
from workflows.domain.spec import parse_spec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str, str]]:
    c = Cluster(tmp_path_factory.mktemp("telemetry"))
    scheduler, agent = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    try:
        c.server.start()
        c.spawn("control", "control")
        c.spawn("scheduler", "scheduler", "--metrics", scheduler)
        c.spawn_agent("m0", "--gpus", "2xL4-24GB", "--metrics", agent)
        c.wait_for(lambda: len(c.json("nodes")) == 1, what="the agent registered")
        yield c, scheduler, agent
    finally:
        c.stop()


def scrape(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint, by name and labels."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_figures_move_with_a_run(cluster: tuple[Cluster, str, str], tmp_path: Path) -> None:
    c, scheduler, agent = cluster
    free, used = (
        ("astraeus_gpus", (("machine", "m0"), ("state", "free"))),
        ("astraeus_gpus", (("machine", "m0"), ("state", "used"))),
    )
    placed = ("astraeus_placement_decisions_total", (("outcome", "placed"),))
    waited = ("astraeus_pending_to_placed_seconds_count", (("namespace", "default"),))
    runs = ("astraeus_runs", (("namespace", "default"), ("state", "placed")))
    before = c.wait_for(lambda: (s := scrape(scheduler)).get(free) == 2 and s, what="the scheduler's first pass")
    assert before.get(used) == 0 and before.get(placed, 0) == 0 and before.get(runs, 0) == 0
    spec = tmp_path / "one.yaml"
    spec.write_text(textwrap.dedent("""\
        name: one-gpu
        groups: [{name: w, command: ["sleep", "30"], gpus: 1, cpu: 0.1, memory_bytes: 1000000}]
    """))  # fmt: skip
    c.cli("submit", str(spec))
    c.wait_state("one-gpu", "Running")
    after = scrape(scheduler)
    assert (after[free], after[used], after[placed], after[waited], after[runs]) == (1, 1, 1, 1, 1)
    assert after[("astraeus_scheduler_pass_seconds_count", ())] > before[("astraeus_scheduler_pass_seconds_count", ())]
    assert any(name.startswith("temporal_") for name, _ in after)  # the SDK runtime's own, on the same endpoint
    assert any(name.startswith("temporal_activity") for name, _ in scrape(agent))  # the agent ran activities
    c.cli("cancel", "one-gpu")
    c.wait_state("one-gpu", "Cancelled")
    c.wait_for(lambda: scrape(scheduler).get(used) == 0, what="the GPU given back")


async def test_one_trace_follows_a_run_from_submit_to_its_workers_start(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    embedded = Embedded(
        tmp_path / "dev", port=free_port(), ui_port=None, telemetry=Telemetry(interceptors=tracing(provider))
    )
    async with embedded:
        assert embedded.client is not None
        client = AstraeusClient(embedded.client)
        await client.submit(parse_spec({"name": "traced", "groups": [{"name": "w", "command": ["true"]}]}))
        status = await client.result("default", "traced")
        assert status.state == "Completed"
    spans = exporter.get_finished_spans()
    by_name = {s.name: s for s in spans}
    names = ("StartWorkflow:JobWorkflow", "RunWorkflow:JobWorkflow", "RunActivity:run_task")
    assert set(names) <= set(by_name), sorted(by_name)
    assert len({by_name[n].context.trace_id for n in names}) == 1
