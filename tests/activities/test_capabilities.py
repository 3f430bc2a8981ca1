"""What a machine reports it can do for its workers, and setting it up for one attempt, with the spec's reasons."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from activities.agent import wireguard
from activities.agent.capabilities import (
    MESH_NEEDS,
    OUTBOUND_NEEDS,
    CapabilitySetup,
    Services,
    SetUp,
    machine_capabilities,
)
from activities.agent.node_network import PROCESS_NETWORK
from activities.agent.runtime import egress
from activities.agent.runtime.base import RuntimeFailure, RuntimeUnavailable
from activities.agent.runtime.docker import DOCKER_EGRESS
from activities.agent.runtime.process import PROCESS_SANDBOX, ProcessRuntime
from workflows.domain.group_parts import Capabilities, OutboundPolicy
from workflows.domain.reasons import Reason

TOOLLESS = "its agent was started without --tool-gateway"


class Engine(ProcessRuntime):
    """A runtime whose engine lists these OCI runtimes (or does not answer)."""

    def __init__(self, root: Path, runtimes: set[str] | None) -> None:
        super().__init__(root)
        self._runtimes = runtimes

    def node_network(self, subnet: str) -> str:
        return "astraeus-node-m"

    def engine_runtimes(self) -> set[str]:
        if self._runtimes is None:
            raise RuntimeUnavailable("the Docker engine does not answer: connection refused")
        return self._runtimes


@pytest.mark.parametrize(
    ("runtimes", "services", "found", "why"),
    [
        pytest.param(
            "process",
            Services(),
            [],
            {
                "outbound_policy": OUTBOUND_NEEDS,
                "sandbox": PROCESS_SANDBOX,
                "tool_gateway": "its agent was started without --tool-gateway",
                "node_network": PROCESS_NETWORK,
                "mesh": MESH_NEEDS,
            },
            id="a process machine has none",
        ),
        pytest.param(
            {"runc", "runsc"},
            Services(tool_gateway="http://127.0.0.1:9000"),
            ["sandbox", "tool_gateway", "node_network"],
            {"outbound_policy": OUTBOUND_NEEDS, "mesh": MESH_NEEDS},
            id="an engine with runsc and a gateway",
        ),
        pytest.param(
            {"runc"},
            Services(),
            ["node_network"],
            {
                "outbound_policy": OUTBOUND_NEEDS,
                "sandbox": "gVisor's runsc is not registered with its Docker engine (it has runc)",
                "tool_gateway": "its agent was started without --tool-gateway",
                "mesh": MESH_NEEDS,
            },
            id="an engine without runsc",
        ),
        pytest.param(
            None,
            Services(),
            ["node_network"],
            {
                "outbound_policy": OUTBOUND_NEEDS,
                "sandbox": "the Docker engine does not answer: connection refused",
                "tool_gateway": "its agent was started without --tool-gateway",
                "mesh": MESH_NEEDS,
            },
            id="an engine that does not answer",
        ),
    ],
)
def test_the_agent_reports_what_its_machine_can_do_and_why_not(
    tmp_path: Path, runtimes: object, services: Services, found: list[str], why: dict[str, str]
) -> None:
    runtime = ProcessRuntime(tmp_path) if runtimes == "process" else Engine(tmp_path, runtimes)  # type: ignore[arg-type]
    assert machine_capabilities(runtime, services, {}) == (found, why)


def test_an_operators_note_replaces_the_agents_own_why(tmp_path: Path) -> None:
    notes = {"outbound_policy": "no egress proxy on this rack", "sandbox": "ignored: it has one"}
    found, why = machine_capabilities(Engine(tmp_path, {"runsc"}), Services(), notes)
    assert (found, why["outbound_policy"]) == (["sandbox", "node_network"], "no egress proxy on this rack")
    assert "sandbox" not in why


def test_a_machine_given_a_mesh_endpoint_is_in_the_mesh_where_it_can_make_a_wireguard_interface(
    tmp_path: Path,
) -> None:
    meshed = Services(mesh_endpoint="192.0.2.1:51820")
    found, why = machine_capabilities(Engine(tmp_path, {"runc"}), meshed, {})
    assert ("mesh" in found, "mesh" in why) == ((True, False) if wireguard.missing(None) is None else (False, True))
    found, why = machine_capabilities(ProcessRuntime(tmp_path), meshed, {})
    assert ("mesh" not in found, why["mesh"]) == (True, PROCESS_NETWORK)
    found, why = machine_capabilities(Engine(tmp_path, {"runc"}), Services(mesh_endpoint="h:1", mesh_netns="nope"), {})
    assert why["mesh"] in ("there is no network namespace nope (`ip netns list`)", wireguard.missing(None))


@pytest.fixture
def model_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def failure(setup: CapabilitySetup, wanted: Capabilities) -> Reason:
    with pytest.raises(RuntimeFailure) as raised:
        setup.set_up(wanted)
    return raised.value.reason


def test_a_worker_gets_its_machines_gateway_model_server_and_sandbox(model_server: str) -> None:
    services = Services("runsc", "http://gateway:9000", model_server)
    setup = CapabilitySetup(services, ["sandbox", "tool_gateway"], {})
    wanted = Capabilities(sandbox=True, tool_gateway=True, model_server=True)
    assert setup.set_up(wanted) == SetUp(
        {"ASTRAEUS_TOOL_GATEWAY": "http://gateway:9000", "ASTRAEUS_MODEL_SERVER": model_server}, "runsc"
    )
    assert setup.set_up(None) == SetUp()


def test_a_model_server_that_is_not_there_or_does_not_answer_fails_the_set_up() -> None:
    wanted = Capabilities(model_server=True)
    assert failure(CapabilitySetup(Services(), [], {}), wanted) == Reason(
        "ModelServerFailed", "Model server: this machine serves no model (its agent was started without --model-server)"
    )
    silent = CapabilitySetup(Services(model_server="http://127.0.0.1:1/"), [], {})
    assert failure(silent, wanted) == Reason(
        "ModelServerFailed", "Model server: http://127.0.0.1:1/ does not answer: [Errno 111] Connection refused"
    )


def test_what_the_machine_cannot_do_fails_the_set_up_with_its_why() -> None:
    setup = CapabilitySetup(Services(), [], {"sandbox": PROCESS_SANDBOX, "outbound_policy": OUTBOUND_NEEDS})
    assert failure(setup, Capabilities(sandbox=True)) == Reason(
        "AgentSandboxFailed", f"Agent sandbox: {PROCESS_SANDBOX}"
    )
    policy = Capabilities(outbound_policy=OutboundPolicy(allow=["10.0.0.0/8"]))
    assert failure(setup, policy) == Reason("OutboundPolicyFailed", f"Outbound policy: {OUTBOUND_NEEDS}")


def test_an_agent_asked_to_enforce_outbound_policies_does_so_on_processes_not_containers(tmp_path: Path) -> None:
    found, why = machine_capabilities(Engine(tmp_path, {"runsc"}), Services(outbound_policy=True), {})
    assert (found, why) == (
        ["sandbox", "node_network"],
        {"outbound_policy": DOCKER_EGRESS, "tool_gateway": TOOLLESS, "mesh": MESH_NEEDS},
    )
    found, _ = machine_capabilities(ProcessRuntime(tmp_path), Services(outbound_policy=True), {})
    assert found == (["outbound_policy"] if egress.missing() is None else [])


def test_an_outbound_policy_allows_networks_and_what_host_names_resolve_to_now() -> None:
    setup = CapabilitySetup(Services(outbound_policy=True), ["outbound_policy"], {})
    policy = Capabilities(outbound_policy=OutboundPolicy(allow=["10.0.0.0/8", "localhost", "192.0.2.7"]))
    assert setup.set_up(policy).egress == ("10.0.0.0/8", "127.0.0.1/32", "192.0.2.7/32")
