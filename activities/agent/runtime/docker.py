"""The `docker` runtime: each attempt is a container of a Docker engine, through the docker SDK.

The one module that imports `docker`: the engine's errors become our reasons here (RuntimeFailure) or
RuntimeUnavailable when the engine itself does not answer. A container is named after its attempt
(`astraeus.<namespace>.<job>.<task>.<attempt>`) and labelled with its run, worker, attempt, machine and GPUs, so
an agent that restarts finds its containers again, and a retried start finds the one it created: the engine
refuses a second container of the same name, and a container that ever started is never started again.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import threading
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import docker
import requests
from docker.errors import APIError, DockerException, NotFound
from docker.models.containers import Container
from docker.models.networks import Network
from docker.types import DeviceRequest
from docker.types import Mount as DockerMount
from docker.utils import parse_repository_tag
from docker.utils.socket import STDERR

from activities.agent.runtime.base import (
    EXEC_TIMED_OUT,
    ExecRefused,
    Executed,
    Launch,
    NetworkNotUp,
    Observed,
    OnProgress,
    RuntimeFailure,
    RuntimeUnavailable,
    ignore_progress,
    ran_too_long,
)
from activities.agent.runtime.containers import (
    LABEL_PREFIX,
    attempt_of,
    container_environment,
    container_labels,
    container_name,
    engine_time,
    node_network_name,
    trim_bytes,
)
from activities.agent.runtime.probes import exited, http_get, timed_out
from workflows.domain.group_parts import Readiness
from workflows.domain.reasons import R, Reason, Template
from workflows.domain.refs import TaskRef
from workflows.domain.subnets import gateway, highest_free

DEFAULT_HOST = "unix:///var/run/docker.sock"
BRIDGE_NAME_OPTION = "com.docker.network.bridge.name"  # a network's bridge named by its maker
# What the engine says of a container that was created and never started.
_NEVER_STARTED = "0001-01-01T00:00:00Z"
_RUNNING_STATES = ["running", "paused", "restarting"]
_EXEC_POLL_SECONDS = 0.05
_SIGKILLED = 128 + 9
# How long after a container's end its out-of-memory event may still reach the engine.
_OOM_EVENT_GRACE_SECONDS = 1.0


class DockerRuntime:
    """Runs attempts as containers of the Docker engine at `base_url` (default: $DOCKER_HOST, else the socket)."""

    name = "docker"
    pulls_images = True

    def __init__(self, node: str, base_url: str | None = None, timeout_seconds: int = 60) -> None:
        self.node = node
        self.base_url = base_url or os.environ.get("DOCKER_HOST") or DEFAULT_HOST
        try:
            self._client = docker.DockerClient(base_url=self.base_url, timeout=timeout_seconds)
            self._client.ping()
        except (DockerException, requests.RequestException) as err:
            raise RuntimeUnavailable(f"the Docker engine at {self.base_url} does not answer: {err}") from err
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._oom: dict[str, bool] = {}

    def close(self) -> None:
        self._client.close()

    # ---- the port ---------------------------------------------------------------------------------------------

    def start(self, key: TaskRef, launch: Launch, on_progress: OnProgress = ignore_progress) -> None:
        """Pull the image under the launch's policy, create the container and start it, unless it exists.
        Returns once the container runs (or already ended); a container that ever started is left alone."""
        if not launch.command:
            raise RuntimeFailure(R.InvalidTask(error="the command is empty"))
        if not launch.image:
            raise RuntimeFailure(R.InvalidTask(error="no image: the docker runtime runs a container image"))
        if launch.egress is not None:
            raise RuntimeFailure(R.OutboundPolicyFailed(why=DOCKER_EGRESS))
        with self._attempt_lock(key):
            container = self._find(key)
            if container is None:
                self._ensure_image(launch.image, launch, on_progress)
                container = self._create(key, launch)
            if _never_started(container):
                with _mapped(R.ContainerStartFailed, launch):
                    container.start()

    def engine_runtimes(self) -> set[str]:
        """The OCI runtimes registered with the engine (runc, and runsc where gVisor is registered)."""
        with _engine():
            return set(self._client.info().get("Runtimes") or {})

    def node_bridge(self) -> str:
        """The Linux bridge of the machine's node network, which the mesh's firewall rules name: the engine names a
        network's bridge `br-<the first 12 characters of its id>` unless the network names it. Raises NetworkNotUp."""
        network = self._node_network()
        named: str | None = (network.attrs.get("Options") or {}).get(BRIDGE_NAME_OPTION)
        return named or f"br-{network.id[:12]}"

    def node_network(self, subnet: str) -> str:
        """The machine's node network: a bridge network of the engine with `subnet`, made unless it is there; one
        left with another subnet (the machine was given another) is replaced. Returns its name."""
        name = node_network_name(self.node)
        try:
            for network in self._client.networks.list(names=[name]):
                configs = (network.attrs.get("IPAM") or {}).get("Config") or []
                if network.name == name and [c.get("Subnet") for c in configs] == [subnet]:
                    return name
                if network.name == name:
                    network.remove()  # refused while workers are on it: it is tried again later
            ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=subnet, gateway=gateway(subnet))])
            labels = {LABEL_PREFIX + "node": self.node, LABEL_PREFIX + "subnet": subnet}
            self._client.networks.create(name, driver="bridge", ipam=ipam, labels=labels, check_duplicate=True)
        except APIError as err:
            raise NetworkNotUp(explain(err)) from err
        except (DockerException, requests.RequestException) as err:
            raise NetworkNotUp(str(_unavailable(err))) from err
        return name

    def hold_node_address(self, held: Collection[str]) -> str:
        """An address of the node network for a worker to start on later (a gang member at the barrier, whose
        address is MASTER_ADDR before it starts), clear of the workers on the network and of `held` (held for
        others, not started yet): `domain/subnets.highest_free`. Raises NetworkNotUp when none is free."""
        network = self._node_network()
        configs = (network.attrs.get("IPAM") or {}).get("Config") or []
        if not configs or not configs[0].get("Subnet"):
            raise NetworkNotUp(f"network {network.name} has no subnet")
        subnet = configs[0]["Subnet"]
        attached = {
            str(c.get("IPv4Address", "")).partition("/")[0] for c in (network.attrs.get("Containers") or {}).values()
        }
        address = highest_free(subnet, attached | set(held))
        if address is None:
            raise NetworkNotUp(f"every address of {subnet} is in use")
        return address

    def _node_network(self) -> Network:
        """The machine's node network as the engine has it; raises NetworkNotUp."""
        try:
            return self._client.networks.get(node_network_name(self.node))
        except APIError as err:
            raise NetworkNotUp(explain(err)) from err
        except (DockerException, requests.RequestException) as err:
            raise NetworkNotUp(str(_unavailable(err))) from err

    def node_address(self, key: TaskRef) -> str | None:
        """The attempt's address on the machine's node network, None when it is not on it (or gone)."""
        container = self._find(key)
        networks = ((container.attrs.get("NetworkSettings") or {}).get("Networks") or {}) if container else {}
        address = (networks.get(node_network_name(self.node)) or {}).get("IPAddress")
        return str(address) if address else None

    def ensure_image(self, launch: Launch, on_progress: OnProgress = ignore_progress) -> None:
        """Pull the launch's image under its policy, creating nothing (a gang member waiting at the barrier)."""
        if not launch.image:
            raise RuntimeFailure(R.InvalidTask(error="no image: the docker runtime runs a container image"))
        self._ensure_image(launch.image, launch, on_progress)

    def probe(self, key: TaskRef, readiness: Readiness) -> tuple[bool, str]:
        """The command `exec`'d in the container, or an HTTP GET to the container's address (127.0.0.1 when it
        shares the machine's network), from this machine."""
        container = self._find(key)
        if container is None or container.attrs["State"]["Status"] != "running":
            return False, "the container is not running"
        if readiness.http_get is not None:
            address = container_address(container)
            if address is None:
                return False, "the container has no network address"
            return http_get(address, readiness.http_get, readiness.timeout_seconds)
        assert readiness.command is not None
        return self._exec(container, readiness.command, readiness.timeout_seconds)

    def ended_fd(self, key: TaskRef) -> int | None:
        """None: the engine's events are not watched per container; the agent polls `observe`."""
        return None

    def observe(self, key: TaskRef) -> Observed:
        """Running while the engine says so; exited with its code and whether the kernel killed it for memory;
        not found when there is no container, or one that never started."""
        container = self._find(key)
        if container is None or _never_started(container):
            return Observed(running=False, not_found=True)
        state = container.attrs["State"]
        if state["Status"] in _RUNNING_STATES:
            return Observed(running=True)
        ended = engine_time(state.get("FinishedAt"))
        oom = self._oom_killed(container)
        return Observed(running=False, exit_code=int(state["ExitCode"]), oom=oom, ended_at=ended)

    def stop(self, key: TaskRef, grace_seconds: float) -> None:
        """SIGTERM (or the image's stop signal), the grace period, then SIGKILL; returns once it has ended."""
        container = self._find(key)
        if container is None or container.attrs["State"]["Status"] not in _RUNNING_STATES:
            return
        with _engine():
            try:
                container.stop(timeout=math.ceil(grace_seconds))
            except NotFound:
                return  # removed meanwhile: it has ended

    def log_tail(self, key: TaskRef, lines: int, max_bytes: int) -> str:
        """The last `lines` lines of its stdout and stderr (interleaved as written), at most `max_bytes`."""
        if lines <= 0 or max_bytes <= 0:
            return ""
        container = self._find(key)
        if container is None:
            return ""
        with _engine():
            try:
                data: bytes = container.logs(stdout=True, stderr=True, tail=lines)
            except NotFound:
                return ""
        return trim_bytes(data, max_bytes).decode("utf-8", errors="replace")

    def gpus_in_use(self) -> dict[str, list[int]]:
        """GPU indices held by this machine's containers that still run, by attempt slug (from their labels)."""
        held: dict[str, list[int]] = {}
        for container in self._containers(status=_RUNNING_STATES):
            labels = container.labels
            key = attempt_of(labels)
            if key is not None:
                gpus = labels.get(LABEL_PREFIX + "gpus", "")
                held[key.slug] = [int(index) for index in gpus.split(",") if index]
        return held

    def ports_in_use(self) -> dict[str, dict[str, int]]:
        """The machine's ports held by containers that still run, by attempt slug (from their labels)."""
        held: dict[str, dict[str, int]] = {}
        for container in self._containers(status=_RUNNING_STATES):
            key = attempt_of(container.labels)
            text = container.labels.get(LABEL_PREFIX + "ports", "")
            if key is not None and text:
                pairs = (item.partition("=") for item in text.split(","))
                held[key.slug] = {name: int(port) for name, _, port in pairs}
        return held

    def attempts(self) -> list[TaskRef]:
        """Every attempt this machine has a container for, running or ended."""
        keys = (attempt_of(container.labels) for container in self._containers())
        return sorted((key for key in keys if key is not None), key=lambda key: key.slug)

    def running(self) -> list[TaskRef]:
        """The attempts whose container the engine says runs (or is paused, or restarting), from their labels."""
        keys = (attempt_of(container.labels) for container in self._containers(status=_RUNNING_STATES))
        return sorted((key for key in keys if key is not None), key=lambda key: key.slug)

    def delete(self, key: TaskRef) -> None:
        """Remove an ended attempt's container, and its logs with it. Deleting a missing one does nothing."""
        container = self._find(key)
        if container is None:
            return
        if container.attrs["State"]["Status"] in _RUNNING_STATES:
            raise ValueError(f"attempt {key.slug} still runs: stop it before deleting it")
        with _engine():
            try:
                container.remove()
            except NotFound:
                return

    # ---- steps ------------------------------------------------------------------------------------------------

    def _ensure_image(self, image: str, launch: Launch, on_progress: OnProgress) -> None:
        """Pull under the policy: Always pulls, IfNotPresent pulls a missing image, None never pulls."""
        present = self._image_present(image)
        if launch.pull_policy == "None":
            if not present:
                raise RuntimeFailure(R.ImageNotPresent(image=image))
            return
        if launch.pull_policy == "IfNotPresent" and present:
            return
        on_progress(R.Pulling(image=image))
        repository, tag = parse_repository_tag(image)
        auth = launch.registry_auth
        auth_config = {"username": auth.username, "password": auth.password} if auth else None
        with _mapped(R.ErrImagePull):
            self._client.images.pull(repository, tag=tag or "latest", auth_config=auth_config)

    def _create(self, key: TaskRef, launch: Launch) -> Container:
        """Create the attempt's container; one created meanwhile by another start of it is the one."""
        assert launch.image is not None
        options: dict[str, Any] = {
            "image": launch.image,
            "command": launch.command,
            "name": container_name(key),
            "labels": container_labels(key, self.node, launch.gpu_indices, launch.ports),
            "environment": container_environment(key, launch),
            "detach": True,
            "mounts": [
                DockerMount(target=m.target, source=m.source, type=m.kind, read_only=m.read_only) for m in launch.mounts
            ],
        }
        if launch.network is not None:  # the machine's node network, under the worker's own name there
            aliases = [launch.network_alias] if launch.network_alias else None
            options["network"] = launch.network
            endpoint = self._client.api.create_endpoint_config(aliases=aliases, ipv4_address=launch.network_ip)
            options["networking_config"] = {launch.network: endpoint}
        if launch.host_network:
            options["network_mode"] = "host"
        elif launch.ports:  # the machine's port, on every address, to the port the worker listens on
            options["ports"] = {f"{p.port}/tcp": p.host_port for p in launch.ports}
        if launch.sandbox_runtime is not None:
            options["runtime"] = launch.sandbox_runtime
        if launch.memory_bytes > 0:
            # Swap counted in the same limit, so that exceeding it is an OOM kill rather than swapping.
            options.update(mem_limit=launch.memory_bytes, memswap_limit=launch.memory_bytes)
        if launch.cpu > 0:
            options["nano_cpus"] = int(launch.cpu * 1e9)
        if launch.gpu_indices:
            # Exactly the GPUs it was given, through the NVIDIA runtime; an engine without it refuses the container.
            device_ids = [str(index) for index in launch.gpu_indices]
            options["device_requests"] = [DeviceRequest(driver="nvidia", device_ids=device_ids, capabilities=[["gpu"]])]
        try:
            return self._client.containers.create(**options)
        except APIError as err:
            if err.status_code == 409:  # a start of the same attempt created it meanwhile
                existing = self._find(key)
                if existing is not None:
                    return existing
            # The engine refuses a bad parameter (a mount, a host path, a limit) with 400: the task is invalid.
            template = R.InvalidTask if err.status_code == 400 else R.ContainerCreateFailed
            raise RuntimeFailure(_refused(template, launch, explain(err))) from err
        except (DockerException, requests.RequestException) as err:
            raise _unavailable(err) from err

    def exec(self, key: TaskRef, argv: list[str], stdin: bytes, timeout_seconds: float) -> Executed:
        """`exec` in the running container, its input written to the exec's stream and its output read back apart
        (stdout, stderr). The engine cannot end an exec: one past its timeout is left to finish on its own (as the
        kubelet does), and what it wrote until then is kept."""
        container = self._find(key)
        if container is None or container.attrs["State"]["Status"] != "running":
            raise ExecRefused("the container is not running")
        api = self._client.api
        try:
            exec_id = api.exec_create(container.id, argv, stdin=True, stdout=True, stderr=True)["Id"]
            stream = api.exec_start(exec_id, socket=True)
        except NotFound:
            raise ExecRefused("the container is not running") from None
        except APIError as err:
            raise ExecRefused(explain(err)) from None
        except (DockerException, requests.RequestException) as err:
            raise _unavailable(err) from err
        raw: socket.socket = getattr(stream, "_sock", stream)
        received = bytearray()
        deadline = time.monotonic() + timeout_seconds
        try:
            raw.settimeout(timeout_seconds)
            raw.sendall(stdin)
            raw.shutdown(socket.SHUT_WR)  # its input ends: a shell reading it exits at its end
            while chunk := _receive(raw, deadline):
                received += chunk
        except TimeoutError:
            stdout, stderr = _demuxed(bytes(received))
            return Executed(EXEC_TIMED_OUT, stdout, stderr + ran_too_long(timeout_seconds))
        finally:
            stream.close()
        stdout, stderr = _demuxed(bytes(received))
        deadline = time.monotonic() + 5
        while (code := api.exec_inspect(exec_id)["ExitCode"]) is None and time.monotonic() < deadline:
            time.sleep(_EXEC_POLL_SECONDS)  # the stream ends a moment before the engine records the exit
        if code is None:
            raise ExecRefused("the engine did not say how the command ended")
        return Executed(int(code), stdout, stderr)

    def _exec(self, container: Container, command: list[str], timeout_seconds: float) -> tuple[bool, str]:
        """Run `command` in the container and wait for its exit code up to the timeout. The engine cannot end an
        exec: one that outlives its timeout is left to finish on its own (as the kubelet does)."""
        api = self._client.api
        deadline = time.monotonic() + timeout_seconds
        try:
            exec_id = api.exec_create(container.id, command, stdout=False, stderr=False)["Id"]
            api.exec_start(exec_id, detach=True)
            while True:
                state = api.exec_inspect(exec_id)
                if not state["Running"] and state["ExitCode"] is not None:
                    code = int(state["ExitCode"])
                    return code == 0, exited(code)
                if time.monotonic() >= deadline:
                    return False, timed_out(timeout_seconds)
                time.sleep(_EXEC_POLL_SECONDS)
        except NotFound:
            return False, "the container is not running"
        except APIError as err:  # not running any more (409), or a program missing from the image (400)
            return False, explain(err)
        except (DockerException, requests.RequestException) as err:
            raise _unavailable(err) from err

    # ---- the engine -------------------------------------------------------------------------------------------

    def _find(self, key: TaskRef) -> Container | None:
        with _engine():
            try:
                return self._client.containers.get(container_name(key))
            except NotFound:
                return None

    def _oom_killed(self, container: Container) -> bool:
        """Whether the kernel killed the ended container for memory. The engine's `OOMKilled` misses a kill whose
        out-of-memory event reached it after the exit (it then stays false), so a SIGKILL of a container with a
        memory limit asks the engine's events too, up to a second after the end. Remembered per container."""
        state = container.attrs["State"]
        if state["OOMKilled"]:
            return True
        if int(state["ExitCode"]) != _SIGKILLED or not container.attrs["HostConfig"].get("Memory"):
            return False
        if container.id not in self._oom:
            started = engine_time(state.get("StartedAt")) or 0.0
            ended = engine_time(state.get("FinishedAt")) or time.time()
            until = max(time.time(), ended + _OOM_EVENT_GRACE_SECONDS)
            filters = {"type": "container", "container": container.id, "event": "oom"}
            with _engine():
                events = self._client.events(since=f"{started:.6f}", until=f"{until:.6f}", filters=filters, decode=True)
                self._oom[container.id] = any(True for _ in events)
        return self._oom[container.id]

    def _image_present(self, image: str) -> bool:
        with _engine():
            try:
                self._client.images.get(image)
            except NotFound:
                return False
        return True

    def _containers(self, status: list[str] | None = None) -> list[Container]:
        filters: dict[str, Any] = {"label": [f"{LABEL_PREFIX}node={self.node}"]}
        if status:
            filters["status"] = status
        with _engine():
            containers: list[Container] = self._client.containers.list(all=True, filters=filters)
        return containers

    @contextmanager
    def _attempt_lock(self, key: TaskRef) -> Iterator[None]:
        """Two starts of one attempt at once (a retried activity) create and start one container."""
        with self._locks_guard:
            lock = self._locks.setdefault(key.slug, threading.Lock())
        with lock:
            yield


@contextmanager
def _engine() -> Iterator[None]:
    """Any error but NotFound (which callers handle) means the engine cannot serve us: RuntimeUnavailable."""
    try:
        yield
    except NotFound:
        raise
    except (DockerException, requests.RequestException) as err:
        raise _unavailable(err) from err


DOCKER_EGRESS = (
    "the docker runtime does not enforce outbound policies yet: it needs each container on a network of its own "
    "with firewall rules on the machine; the process runtime enforces them (--outbound-policy)"
)


def _refused(template: Template, launch: Launch, error: str) -> Reason:
    """The engine's refusal to create or start a container: the step's reason, but "Agent sandbox: <why>" for a
    sandboxed worker's (its sandbox runtime is what refuses it, whatever the status)."""
    if launch.sandbox_runtime is not None:
        return R.AgentSandboxFailed(why=error)
    return template(error=error)


@contextmanager
def _mapped(template: Template, launch: Launch | None = None) -> Iterator[None]:
    """The engine's refusal of this step becomes the step's reason, e.g. "ErrImagePull: <error>"."""
    try:
        yield
    except APIError as err:
        reason = template(error=explain(err)) if launch is None else _refused(template, launch, explain(err))
        raise RuntimeFailure(reason) from err
    except (DockerException, requests.RequestException) as err:
        raise _unavailable(err) from err


def _unavailable(err: Exception) -> RuntimeUnavailable:
    return RuntimeUnavailable(f"the Docker engine does not answer: {err}")


def _receive(raw: socket.socket, deadline: float) -> bytes:
    """The next bytes of an exec's stream, b"" at its end; TimeoutError past the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    raw.settimeout(left)
    return raw.recv(1 << 16)


def _demuxed(received: bytes) -> tuple[bytes, bytes]:
    """An exec's stream (frames of an 8-byte header: the stream, 1 or 2, and the length) as its stdout and stderr;
    a frame cut short (the stream was left at a timeout) is kept as far as it came."""
    out, err, at = bytearray(), bytearray(), 0
    while at + 8 <= len(received):
        stream, length = struct.unpack(">BxxxL", received[at : at + 8])
        (err if stream == STDERR else out).extend(received[at + 8 : at + 8 + length])
        at += 8 + length
    return bytes(out), bytes(err)


def explain(err: APIError) -> str:
    """The engine's own words, without the HTTP status line the SDK puts before them."""
    explanation = err.explanation
    if isinstance(explanation, bytes):
        explanation = explanation.decode("utf-8", errors="replace")
    return str(explanation or err).strip()


def _never_started(container: Container) -> bool:
    return bool(container.attrs["State"].get("StartedAt", _NEVER_STARTED).startswith("0001-01-01"))


def container_address(container: Container) -> str | None:
    """Where the machine reaches the container: loopback on the host's network, else its address on a network."""
    if container.attrs["HostConfig"].get("NetworkMode") == "host":
        return "127.0.0.1"
    settings = container.attrs.get("NetworkSettings") or {}
    if settings.get("IPAddress"):
        return str(settings["IPAddress"])
    networks = settings.get("Networks") or {}
    addresses = [str(networks[name].get("IPAddress") or "") for name in sorted(networks)]
    return next((address for address in addresses if address), None)
