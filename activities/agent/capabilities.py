"""What this machine offers its workers besides room (its capabilities), and setting them up for one attempt.

The agent finds them out when it starts, and its machine reports them to the scheduler, with why each one is
missing (shown in the per-machine reasons: "machine cannot run sandboxed workers (<why>)"):

- `sandbox`: a Docker engine with gVisor's runtime registered (`--sandbox-runtime`, default `runsc`); a sandboxed
  worker's container runs under it. The process runtime has none.
- `tool_gateway`: the gateway URL given with `--tool-gateway`, handed to the worker as ASTRAEUS_TOOL_GATEWAY.
- `node_network`: a runtime whose workers can join a network with the machine's subnet (the docker runtime's; the
  process runtime's workers share the machine's own network): `activities/agent/node_network.py`.
- `mesh`: the node network's mesh between machines, with `--mesh-endpoint` on a machine that hosts the node network
  and can make a WireGuard interface (`activities/agent/mesh.py`); a run on the node network that is not kept on one
  machine goes only to machines in it.
- `outbound_policy`: with `--outbound-policy`, on the process runtime as root with `ip` and `iptables`: each such
  worker runs in a network namespace of its own whose firewall allows only the networks listed (host names are
  resolved when the worker is set up; `activities/agent/runtime/egress.py`). The docker runtime does not enforce them
  yet.

A model server (`--model-server`) is set up per attempt only: the worker gets ASTRAEUS_MODEL_SERVER once it answers,
else the attempt fails with "Model server: <why>". So is an interactive token (`activities/agent/sessions.py`): a
machine whose agent runs `--no-interactive-sessions` fails such an attempt with "Interactive token: <why>".
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from activities.agent import wireguard
from activities.agent.node_network import network_missing
from activities.agent.runtime import egress
from activities.agent.runtime.base import Runtime, RuntimeFailure, RuntimeUnavailable
from activities.agent.runtime.docker import DOCKER_EGRESS
from activities.agent.runtime.process import PROCESS_SANDBOX
from workflows.domain.group_parts import Capabilities
from workflows.domain.reasons import R
from workflows.domain.scheduling.placement import NODE_MESH, NODE_NETWORK

MODEL_SERVER_TIMEOUT_SECONDS = 5.0
OUTBOUND_NEEDS = "its agent was started without --outbound-policy"
MESH_NEEDS = "its agent was started without --mesh-endpoint, so it is in no mesh between machines"


@dataclass(frozen=True)
class Services:
    """What the agent was told it serves its workers: the engine's sandbox runtime, a tool gateway, a model server."""

    sandbox_runtime: str = "runsc"
    tool_gateway: str | None = None
    model_server: str | None = None
    outbound_policy: bool = False  # enforce outbound policies (process runtime: a namespace and firewall per worker)
    interactive_sessions: bool = True  # host people's sessions in workers that ask an interactive token
    mesh_endpoint: str | None = None  # HOST:PORT (UDP) where other machines reach its WireGuard; None: in no mesh
    mesh_netns: str | None = None  # its engine's network namespace, where its WireGuard interface is; None: its own


@dataclass(frozen=True)
class SetUp:
    """What an attempt gets from its capabilities: variables, and the engine runtime that sandboxes it."""

    env: dict[str, str] = field(default_factory=dict)
    sandbox_runtime: str | None = None
    egress: tuple[str, ...] | None = None


def sandbox_missing(runtime: Runtime, name: str) -> str | None:
    """Why this machine cannot run sandboxed workers, or None when its engine has the sandbox runtime."""
    runtimes = getattr(runtime, "engine_runtimes", None)
    if runtimes is None:
        return PROCESS_SANDBOX
    try:
        registered: set[str] = runtimes()
    except RuntimeUnavailable as err:
        return str(err)
    if name not in registered:
        return f"gVisor's {name} is not registered with its Docker engine (it has {', '.join(sorted(registered))})"
    return None


def outbound_missing(runtime: Runtime) -> str | None:
    """Why this machine cannot enforce outbound policies, though asked to, or None."""
    if getattr(runtime, "engine_runtimes", None) is not None:
        return DOCKER_EGRESS
    return egress.missing()


def mesh_missing(runtime: Runtime, services: Services) -> str | None:
    """Why this machine is in no mesh between machines, or None."""
    if services.mesh_endpoint is None:
        return MESH_NEEDS
    return network_missing(runtime) or wireguard.missing(services.mesh_netns)


def machine_capabilities(
    runtime: Runtime, services: Services, notes: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """The capabilities this machine has, and why each other one is missing (an operator's note, given with
    --capability-note, is shown rather than ours)."""
    missing: dict[str, str] = {}
    outbound = outbound_missing(runtime) if services.outbound_policy else OUTBOUND_NEEDS
    if outbound is not None:
        missing["outbound_policy"] = outbound
    sandbox = sandbox_missing(runtime, services.sandbox_runtime)
    if sandbox is not None:
        missing["sandbox"] = sandbox
    if services.tool_gateway is None:
        missing["tool_gateway"] = "its agent was started without --tool-gateway"
    network = network_missing(runtime)
    if network is not None:
        missing[NODE_NETWORK] = network
    mesh = mesh_missing(runtime, services)
    if mesh is not None:
        missing[NODE_MESH] = mesh
    names = ("outbound_policy", "sandbox", "tool_gateway", NODE_NETWORK, NODE_MESH)
    found = [name for name in names if name not in missing]
    return found, {name: notes.get(name, why) for name, why in missing.items()}


def networks_of(entry: str) -> list[str]:
    """An allowed entry as networks: itself when it is one, else every address its host name resolves to now."""
    try:
        return [str(ipaddress.ip_network(entry))]
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(entry, None, proto=socket.IPPROTO_TCP)
    except OSError as err:
        raise RuntimeFailure(R.OutboundPolicyFailed(why=f"host {entry} does not resolve ({err})")) from None
    return sorted({str(ipaddress.ip_network(info[4][0])) for info in found})


class CapabilitySetup:
    """Sets up what a worker's group requires of its machine, or fails with the spec's set-up reason."""

    def __init__(self, services: Services, capabilities: Iterable[str], notes: dict[str, str]) -> None:
        self.services = services
        self._has = frozenset(capabilities)
        self._notes = dict(notes)

    def set_up(self, wanted: Capabilities | None) -> SetUp:
        """Blocking (a model server is asked whether it answers): call it on a thread."""
        if wanted is None:
            return SetUp()
        env: dict[str, str] = {}
        allowed = None
        if wanted.outbound_policy is not None:
            if "outbound_policy" not in self._has:
                raise RuntimeFailure(R.OutboundPolicyFailed(why=self._notes.get("outbound_policy", OUTBOUND_NEEDS)))
            allowed = tuple(network for entry in wanted.outbound_policy.allow for network in networks_of(entry))
        if wanted.sandbox and "sandbox" not in self._has:
            raise RuntimeFailure(R.AgentSandboxFailed(why=self._notes.get("sandbox", "no sandbox runtime")))
        if wanted.tool_gateway:
            if self.services.tool_gateway is None:
                raise RuntimeFailure(R.InvalidTask(error="this machine serves no tool gateway"))
            env["ASTRAEUS_TOOL_GATEWAY"] = self.services.tool_gateway
        if wanted.model_server:
            env["ASTRAEUS_MODEL_SERVER"] = self._model_server()
        return SetUp(env, self.services.sandbox_runtime if wanted.sandbox else None, allowed)

    def _model_server(self) -> str:
        url = self.services.model_server
        if url is None:
            raise RuntimeFailure(
                R.ModelServerFailed(why="this machine serves no model (its agent was started without --model-server)")
            )
        try:
            answer = httpx.get(url, timeout=MODEL_SERVER_TIMEOUT_SECONDS)
        except httpx.HTTPError as err:
            raise RuntimeFailure(R.ModelServerFailed(why=f"{url} does not answer: {err}")) from None
        if answer.status_code >= 500:
            raise RuntimeFailure(R.ModelServerFailed(why=f"{url} answers {answer.status_code}")) from None
        return url
