"""How the docker runtime names and marks a worker's container, without asking the engine: the names of the container
and of the machine's node network, the labels that say whose attempt a container is (what an agent that restarts
reads back), the worker's environment, and how the engine's times and log tails read. It imports no `docker`."""

from __future__ import annotations

import re
from datetime import datetime

from activities.agent.runtime.base import Launch, port_environment
from workflows.domain.machine.attempts import PortMapping
from workflows.domain.refs import TaskRef

LABEL_PREFIX = "astraeus."


def node_network_name(node: str) -> str:
    """The machine's node network in its engine (several machines may share one engine)."""
    return f"astraeus-node-{node}"


def container_name(key: TaskRef) -> str:
    """The attempt's container: the engine keeps names unique, so a retried start finds its own."""
    return f"astraeus.{key.slug}"


def container_labels(key: TaskRef, node: str, gpus: list[int], ports: list[PortMapping]) -> dict[str, str]:
    return {
        # Its external access, name=machine's port: what an agent that restarts reads as held (ports_in_use).
        LABEL_PREFIX + "ports": ",".join(f"{p.name}={p.host_port}" for p in ports),
        LABEL_PREFIX + "namespace": key.namespace,
        LABEL_PREFIX + "job": key.job,
        LABEL_PREFIX + "task": key.task_id,
        LABEL_PREFIX + "attempt": str(key.attempt),
        LABEL_PREFIX + "node": node,
        LABEL_PREFIX + "gpus": ",".join(str(index) for index in gpus),
    }


def attempt_of(labels: dict[str, str]) -> TaskRef | None:
    try:
        return TaskRef(
            namespace=labels[LABEL_PREFIX + "namespace"],
            job=labels[LABEL_PREFIX + "job"],
            task_id=labels[LABEL_PREFIX + "task"],
            attempt=int(labels[LABEL_PREFIX + "attempt"]),
        )
    except (KeyError, ValueError):
        return None


def container_environment(key: TaskRef, launch: Launch) -> dict[str, str]:
    """The launch's environment, then ours. GPUs are the NVIDIA runtime's to number inside the container."""
    return {
        **launch.env,
        "ASTRAEUS_TASK": key.task_id,
        "ASTRAEUS_RUN": key.job,
        "ASTRAEUS_JOB": key.job,  # the same as ASTRAEUS_RUN, deprecated: kept for a release
        "ASTRAEUS_NAMESPACE": key.namespace,
        "ASTRAEUS_ATTEMPT": str(key.attempt),
        **port_environment(launch.ports, mapped=not launch.host_network),
    }


def trim_bytes(data: bytes, max_bytes: int) -> bytes:
    """The last `max_bytes` bytes of `data`, from a character's start (a cut character would decode longer)."""
    if len(data) <= max_bytes:
        return data
    return data[-max_bytes:].lstrip(bytes(range(0x80, 0xC0)))


def engine_time(text: str | None) -> float | None:
    """The engine's RFC 3339 time (nanoseconds, "Z") as seconds since the epoch; None when unset or unreadable."""
    if not text or text.startswith("0001-"):
        return None
    trimmed = re.sub(r"(\.\d{6})\d+", r"\1", text).replace("Z", "+00:00")
    try:
        return datetime.fromisoformat(trimmed).timestamp()
    except ValueError:
        return None
