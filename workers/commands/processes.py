"""The long-running commands: `dev` (the embedded default), `control`, `scheduler`, `api` and `agent`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
from typing import Any, get_args

from pydantic import ValidationError

from activities.agent.runtime.base import RuntimeUnavailable
from workers.client import AstraeusClient
from workers.commands.inputs import ca_dir, given_path, load_settings
from workers.commands.options import connect_to, temporal_client
from workers.connect import ensure_search_attributes
from workers.errors import AstraeusError
from workflows.domain.constraints import RACK_LABEL, Capability
from workflows.domain.inventory import PortRange
from workflows.domain.spec import format_errors


async def cmd_dev(args: argparse.Namespace) -> int:
    from activities.agent.lease import RegistrationRefused
    from workers.api_serving import DEFAULT_LISTEN
    from workers.devserver import DevServerError
    from workers.embedded import Embedded

    settings = load_settings(args.settings)
    embedded = Embedded(
        data_dir=given_path(args.data_dir),
        port=args.port,
        ui_port=args.ui_port,
        nodes=args.nodes,
        gpus=args.gpus,
        cpus=args.cpus,
        memory_bytes=args.memory_bytes,
        settings=settings,
        runtime=args.runtime,
        docker_host=args.docker_host,
        telemetry=args.telemetry,
    )
    if args.api and args.no_api:
        raise AstraeusError("dev: --api and --no-api: give one")
    try:
        sock = _dev_ports(embedded, None if args.no_api else args.api or DEFAULT_LISTEN)
        try:
            async with embedded:
                print(f"Temporal frontend: {embedded.server.address}")
                print(f"Temporal UI: {embedded.server.ui_address}")
                if sock is None:
                    _say_ready(args.nodes)
                    await _until_signalled()
                else:
                    await _serve_api(embedded, sock, args.nodes)
        finally:
            if sock is not None:
                sock.close()
    except (DevServerError, RegistrationRefused) as error:  # nothing runs, nothing joined another cluster
        raise AstraeusError(f"dev: cannot start: {error}") from None
    return 0


def _say_ready(nodes: int) -> None:
    print(f"{nodes} local machine(s) ready. Submit with: astraeus submit examples/hello.yaml", flush=True)


def _dev_ports(embedded: Any, listen: str | None) -> Any:
    """`dev`'s ports, checked before anything starts: Temporal's, and the API's (bound here, so that it is ours);
    every taken one is named at once, and nothing runs."""
    from workers.api_answers import PortInUse
    from workers.api_serving import bind
    from workers.devserver import port_free, refuse_taken

    taken = [(port, what) for port, what in embedded.server.ports() if not port_free(port)]
    sock = None
    if listen is not None:
        try:
            sock = bind(listen)
        except PortInUse:
            taken.append((int(listen.rpartition(":")[2]), "HTTP API and console"))
    if taken:
        if sock is not None:
            sock.close()
        if listen is None:
            refuse_taken(taken)
        refuse_taken(taken, "another `astraeus dev`, `astraeus api` or Temporal server",
                     "--port, --ui-port and --api (or --no-api)")  # fmt: skip
    return sock


async def _serve_api(embedded: Any, sock: Any, nodes: int) -> None:
    """`dev`'s HTTP API and console, in the same process: an admin token for whoever started it (made anew each
    time; `astraeus token revoke` it when done), and the console's address with a one-time sign-in link for it."""
    from activities.scheduler_link import SchedulerLink
    from workers.admin import create_token
    from workers.api import api_app
    from workers.api_auth import TokenBook
    from workers.api_serving import serve
    from workers.console import SignIn

    client = AstraeusClient(embedded.client, control_build=embedded.control_build)
    secret, _ = await create_token(client.temporal, None, "astraeus dev")
    sign_in = SignIn()
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    scheduler = SchedulerLink(embedded.scheduler_address)
    app = api_app(client, TokenBook(client.temporal), sign_in=sign_in, temporal_ui=embedded.server.ui_address,
                  scheduler=scheduler)  # fmt: skip
    stop = asyncio.Event()
    serving = asyncio.ensure_future(serve(app, sock, stop))
    print(f"Console: {url}/console/#sign-in={sign_in.link(secret)}")
    print(f"HTTP API: {url} (admin token: {secret})")
    _say_ready(nodes)
    try:
        await _until_signalled()
    finally:
        stop.set()
        await serving
        await scheduler.close()


def scheduler_address(given: str | None) -> str:
    """The scheduler's door: the flag, else $ASTRAEUS_SCHEDULER, else 127.0.0.1:7244; refused unless HOST:PORT."""
    from activities.scheduler_link import DEFAULT_ADDRESS, parse_address

    chosen = given or os.environ.get("ASTRAEUS_SCHEDULER") or DEFAULT_ADDRESS
    try:
        parse_address(chosen)
    except ValueError as error:
        raise AstraeusError(str(error)) from None
    return chosen


async def cmd_control(args: argparse.Namespace) -> int:
    from workers.services import ControlWorker

    scheduler = scheduler_address(args.scheduler)
    client = await connect_to(args)
    await ensure_search_attributes(client)
    await ControlWorker(client, load_settings(args.settings), scheduler, ca_dir(args.ca_dir)).run()
    return 0


async def cmd_scheduler(args: argparse.Namespace) -> int:
    from activities.scheduler_link import SchedulerDoor
    from workers.services import scheduler_worker

    settings = load_settings(args.settings)
    listen = scheduler_address(args.listen)
    client = await connect_to(args)
    try:
        door = SchedulerDoor(listen)
    except OSError as error:
        raise AstraeusError(f"scheduler: {error}") from None
    worker = await scheduler_worker(client, door, settings)
    await worker.run()
    return 0


async def cmd_api(args: argparse.Namespace) -> int:
    from activities.scheduler_link import SchedulerLink
    from workers.api import api_app, openapi_document
    from workers.api_auth import TokenBook
    from workers.api_serving import DEFAULT_LISTEN, bind, serve

    if args.openapi:
        print(json.dumps(openapi_document(), indent=2))
        return 0
    load_settings(args.settings)
    sock = bind(args.listen or os.environ.get("ASTRAEUS_API") or DEFAULT_LISTEN)
    client = await temporal_client(args)
    host, port = sock.getsockname()[:2]
    logging.getLogger("astraeus.api").info("serving the HTTP API on http://%s:%s", host, port)
    temporal_ui = args.temporal_ui or os.environ.get("ASTRAEUS_TEMPORAL_UI") or None
    scheduler = SchedulerLink(scheduler_address(args.scheduler))
    try:
        await serve(api_app(client, TokenBook(client.temporal), temporal_ui=temporal_ui, scheduler=scheduler), sock)
    finally:
        await scheduler.close()
    return 0


async def cmd_agent(args: argparse.Namespace) -> int:
    from activities.agent.capabilities import Services
    from activities.agent.lease import LeaseLost, RegistrationRefused
    from activities.agent.machine import MachineReadError, parse_port
    from workers.agent_process import AgentOptions, start_agent

    notes = _capability_notes(args.capability_note)
    try:
        ports = [parse_port(item) for item in args.rdma_port] if args.rdma_port else None
    except MachineReadError as error:
        raise AstraeusError(str(error)) from None
    location = given_path(args.data_location) if args.data_location else None
    if location is not None and not location.is_dir():
        raise AstraeusError(f"--data-location {location}: no such directory")
    options = AgentOptions(
        name=args.name,
        data_dir=given_path(args.data_dir),
        gpus=args.gpus,
        cpus=args.cpus,
        memory_bytes=args.memory_bytes,
        labels=dict(_label(item) for item in args.label) | ({RACK_LABEL: args.rack} if args.rack else {}),
        pools=args.pool,
        accept_labels=dict(_label(item, "--accept-label") for item in args.accept_label),
        site=args.site,
        address=args.address,
        runtime=args.runtime,
        docker_host=args.docker_host,
        host_paths=[str(given_path(prefix)) for prefix in args.host_path],
        rdma_ports=ports,
        ib_fabric=args.ib_fabric,
        capability_notes=notes,
        services=Services(
            args.sandbox_runtime,
            args.tool_gateway,
            args.model_server,
            args.outbound_policy,
            args.interactive_sessions,
            mesh_endpoint=_mesh_endpoint(args.mesh_endpoint),
            mesh_netns=args.mesh_netns,
        ),
        data_location=location,
        refuses_runs=_refusal(args.refuse_runs),
        external_ports=_port_range(args.external_ports),
        sysfs=given_path(args.sysfs),
        procfs=given_path(args.procfs),
    )
    client = await connect_to(args)
    try:
        agent = await start_agent(client, options, load_settings(args.settings))
    except RuntimeUnavailable as error:
        raise AstraeusError(f"--runtime {args.runtime}: {error}") from None
    except RegistrationRefused as error:
        raise AstraeusError(str(error)) from None
    _leave_mesh_when_stopped(agent)
    try:
        await agent.run()
    except LeaseLost as error:
        raise AstraeusError(str(error)) from None
    return 0


def _label(item: str, flag: str = "--label") -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise AstraeusError(f"{flag} {item}: expected KEY=VALUE")
    return key, value


def _port_range(text: str | None) -> PortRange | None:
    """--external-ports FIRST-LAST."""
    if text is None:
        return None
    first, sep, last = text.partition("-")
    try:
        if not sep:
            raise ValueError("expected FIRST-LAST")
        return PortRange(first=int(first), last=int(last))
    except ValidationError as error:
        raise AstraeusError(f"--external-ports {text}: {format_errors(error)}") from None
    except ValueError:
        raise AstraeusError(f"--external-ports {text}: expected FIRST-LAST, e.g. 30000-30099") from None


def _leave_mesh_when_stopped(agent: Any) -> None:
    """SIGTERM or SIGINT ends the agent as before (its workers run on), once its machine has left the mesh: its
    WireGuard interface, wireguard-go and firewall rules go with the agent that owns them."""
    loop = asyncio.get_running_loop()

    def leave(sig: int) -> None:
        agent.activities.node_network.close()
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, leave, sig)


def _mesh_endpoint(endpoint: str | None) -> str | None:
    """--mesh-endpoint HOST:PORT."""
    from workflows.domain.mesh import endpoint_problem

    problem = endpoint_problem(endpoint) if endpoint is not None else None
    if problem is not None:
        raise AstraeusError(f"--mesh-endpoint {problem}")
    return endpoint


def _refusal(why: str | None) -> str | None:
    """--refuse-runs WHY: a reason people read, so never blank."""
    if why is not None and not why.strip():
        raise AstraeusError("--refuse-runs: say why the machine takes no new runs")
    return None if why is None else why.strip()


def _capability_notes(notes: list[str]) -> dict[str, str]:
    """--capability-note NAME=WHY: why a capability the machine lacks is missing, in the operator's words."""
    known = get_args(Capability)
    why: dict[str, str] = {}
    for item in notes:
        name, text = _label(item, "--capability-note")
        if name not in known:
            raise AstraeusError(f"--capability-note {item}: unknown capability {name} (known: {', '.join(known)})")
        why[name] = text
    return why


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
