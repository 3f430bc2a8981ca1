"""Each process's telemetry: traces through Temporal's OpenTelemetry interceptor, exported by OTLP when
`OTEL_EXPORTER_OTLP_ENDPOINT` is set; and, with `--metrics HOST:PORT`, one Prometheus endpoint with the Temporal SDK
runtime's metrics (`temporal_*`) and Astraeus's own (`astraeus_*`, activities/metrics.py)."""

from __future__ import annotations

import logging
import os
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from prometheus_client import REGISTRY, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from temporalio.client import Interceptor
from temporalio.contrib.opentelemetry import TracingInterceptor
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from workers.devserver import free_port

log = logging.getLogger(__name__)

OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
CONSOLE = "ASTRAEUS_TRACES"  # =console: print spans on stderr (without a collector at hand)


class TelemetryError(Exception):
    """`--metrics` cannot be served (a malformed address, a port in use); the message says which."""


@dataclass
class Telemetry:
    """What a process's clients are connected with: the SDK runtime (its metrics) and the tracing interceptor, which
    the SDK also puts on every worker made from the client."""

    runtime: Runtime | None = None
    interceptors: list[Interceptor] = field(default_factory=list)
    provider: TracerProvider | None = None

    def flush(self) -> None:
        """Send the spans still buffered: the CLI ends its process without finalizing it (workers/cli.py: main)."""
        if self.provider is not None:
            self.provider.force_flush(timeout_millis=5000)


def set_up(process: str, metrics: str | None = None, environ: Mapping[str, str] | None = None) -> Telemetry:
    """Traces as the environment asks, metrics where `metrics` (HOST:PORT) says; nothing of either by default."""
    provider = tracer_provider(process, os.environ if environ is None else environ)
    if provider is not None:
        trace.set_tracer_provider(provider)
    return Telemetry(
        runtime=serve_metrics(metrics) if metrics else None,
        interceptors=tracing(provider),
        provider=provider,
    )


def tracer_provider(process: str, environ: Mapping[str, str]) -> TracerProvider | None:
    """A provider exporting by OTLP over HTTP (the OTEL_EXPORTER_OTLP_* variables say where and how), or to the
    console with ASTRAEUS_TRACES=console; None when neither is asked for. The service is `astraeus-<process>`
    unless OTEL_SERVICE_NAME names it."""
    otlp = any(environ.get(name) for name in OTLP_ENDPOINTS)
    console = environ.get(CONSOLE) == "console"
    if not otlp and not console:
        return None
    named = environ.get("OTEL_SERVICE_NAME")  # Resource.create reads it, but what it is given comes first
    provider = TracerProvider(resource=Resource.create({"service.name": named or f"astraeus-{process}"}))
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    return provider


def tracing(provider: TracerProvider | None) -> list[Interceptor]:
    """Temporal's tracing interceptor on `provider`'s tracer: a span for each workflow started, signalled or run,
    and each activity, carried from process to process in Temporal's headers, so one trace follows a run."""
    if provider is None:
        return []
    return [TracingInterceptor(provider.get_tracer("astraeus"))]


def serve_metrics(listen: str) -> Runtime:
    """Serve Prometheus's text format at http://HOST:PORT/metrics (any path answers), and return the SDK runtime
    whose metrics it includes: that runtime serves them on a loopback port of its own, read at each scrape."""
    host, sep, port = listen.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise TelemetryError(f"--metrics {listen}: expected HOST:PORT, e.g. 0.0.0.0:9464")
    inner = f"127.0.0.1:{free_port()}"
    runtime = Runtime(telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=inner)))
    REGISTRY.register(SdkMetrics(f"http://{inner}/metrics"))
    try:
        start_http_server(int(port), addr=host)
    except OSError as error:
        raise TelemetryError(f"--metrics {listen}: {error.strerror or error}") from None
    log.info("metrics at http://%s/metrics", listen)
    return runtime


class SdkMetrics(Collector):
    """The Temporal SDK runtime's metrics, read from its own endpoint when ours is scraped."""

    def __init__(self, url: str) -> None:
        self.url = url

    def describe(self) -> list[Metric]:
        return []  # names unknown before a scrape: the registry does not check them for duplicates

    def collect(self) -> Iterator[Metric]:
        try:
            with urllib.request.urlopen(self.url, timeout=2) as answer:
                text = answer.read().decode()
        except OSError as error:  # not served yet, or gone: our own metrics are still worth a scrape
            log.warning("the Temporal SDK's metrics are unread: %s", error)
            return
        yield from text_string_to_metric_families(text)
