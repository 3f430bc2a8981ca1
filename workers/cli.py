"""`astraeus`: run the embedded default or its parts, submit runs and read why they are where they are."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, get_args

import shtab
import yaml
from pydantic import BaseModel, ByteSize, TypeAdapter, ValidationError
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities.agent.runtime.base import RuntimeUnavailable
from workers import collector
from workers.client import AstraeusClient, AstraeusError, NotFound, Unreachable
from workers.connect import ProfileError, Target, connect, ensure_search_attributes, target
from workers.exits import ExitCode, exit_for_state
from workers.http_client import HttpClient
from workers.render import render_describe, render_events, render_history, render_nodes, render_runs, render_status
from workers.telemetry import Telemetry, TelemetryError, set_up
from workflows.domain.constraints import RACK_LABEL, Capability
from workflows.domain.drives import NewDrive
from workflows.domain.inventory import PortRange
from workflows.domain.run.status import RUN_TERMINAL, RunState, Status
from workflows.domain.run.views import TERMINATED
from workflows.domain.scheduling.quotas import Quota
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, format_errors, parse_spec
from workflows.domain.tombstones import DELETED
from workflows.messages import SESSION_OUTPUT_MAX_BYTES

DISTRIBUTION = "astraeus-orchestrator"  # whose metadata `--version` reads
RUN_STATES = [*(s.value for s in RunState), TERMINATED]  # what `ls --state` and `wait --for` accept
SERVICES = ("dev", "control", "scheduler", "agent", "api")  # the long-running commands (logged, collector tuned)

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
Runs = AstraeusClient | HttpClient  # the verbs over Temporal, or over the HTTP API (--api)


def given_path(value: str) -> Path:
    """A path given on the command line, made absolute where it enters: the processes it is handed to (a worker's
    shim, the Temporal server) start in other directories."""
    return Path(value).expanduser().resolve()


def load_settings(path: str | None) -> Settings:
    """`--settings FILE`: YAML overriding the settings model; unknown keys are errors."""
    if path is None:
        return Settings()
    try:
        data = yaml.safe_load(given_path(path).read_text()) or {}
        return Settings.model_validate(data)
    except (OSError, yaml.YAMLError) as error:
        raise AstraeusError(f"--settings {path}: {error}") from None
    except ValidationError as error:
        raise AstraeusError(f"--settings {path}:\n{format_errors(error)}") from None


def load_spec(path: str) -> JobSpec:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise AstraeusError(f"{path}: {error}") from None
    try:
        return parse_spec(data)
    except ValueError as error:
        raise AstraeusError(f"{path}: invalid run spec:\n{error}") from None


def split_run(run: str, namespace: str) -> tuple[str, str]:
    """`name` (in --namespace), `namespace/name` (as `submit` prints it), or the run's workflow id
    `job/namespace/name` (as the Temporal UI shows it)."""
    parts = run.split("/")
    if len(parts) == 3 and parts[0] == "job":
        parts = parts[1:]
    if len(parts) == 2:
        return parts[0], parts[1]
    if len(parts) == 1:
        return namespace, run
    raise AstraeusError(f"{run}: expected NAME, NAMESPACE/NAME or job/NAMESPACE/NAME")


def seconds(value: str) -> float:
    """`--timeout`: seconds, 0 or more."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{value!r}: expected seconds, 0 or more")
    return number


def positive(value: str) -> int:
    """`--limit`: a count, 1 or more."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number, 1 or more")
    return int(value)


def natural(value: str) -> int:
    """`--after`: a count, 0 or more."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number, 0 or more")
    return int(value)


def byte_size(value: str) -> int:
    """A size on the command line: bytes, or with a unit (`64GiB`, `512MiB`, `80GB`)."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(value))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a size, e.g. 68719476736, 64GiB or 512MiB") from None


def emit(args: argparse.Namespace, value: Any, human: Callable[[], str]) -> None:
    if args.json:
        print(json.dumps(_jsonable(value), indent=2))
    else:
        print(human())


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


# ---- processes --------------------------------------------------------------------------------------------------


async def cmd_dev(args: argparse.Namespace) -> int:
    from activities.agent.lease import RegistrationRefused
    from workers.api import DEFAULT_LISTEN
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
    from workers.api import PortInUse, bind
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
    from workers.api import api_app, serve
    from workers.api_auth import TokenBook
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
    client = await _connect(args)
    await ensure_search_attributes(client)
    await ControlWorker(client, load_settings(args.settings), scheduler, ca_dir(args.ca_dir)).run()
    return 0


async def cmd_scheduler(args: argparse.Namespace) -> int:
    from activities.scheduler_link import SchedulerDoor
    from workers.services import scheduler_worker

    settings = load_settings(args.settings)
    listen = scheduler_address(args.listen)
    client = await _connect(args)
    try:
        door = SchedulerDoor(listen)
    except OSError as error:
        raise AstraeusError(f"scheduler: {error}") from None
    worker = await scheduler_worker(client, door, settings)
    await worker.run()
    return 0


async def cmd_api(args: argparse.Namespace) -> int:
    from activities.scheduler_link import SchedulerLink
    from workers.api import DEFAULT_LISTEN, api_app, bind, openapi_document, serve
    from workers.api_auth import TokenBook

    if args.openapi:
        print(json.dumps(openapi_document(), indent=2))
        return 0
    load_settings(args.settings)
    sock = bind(args.listen or os.environ.get("ASTRAEUS_API") or DEFAULT_LISTEN)
    client = await _temporal_client(args)
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
    from workers.services import AgentOptions, start_agent

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
    client = await _connect(args)
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


# ---- verbs ------------------------------------------------------------------------------------------------------


def _target(args: argparse.Namespace) -> Target:
    """Where this command connects: `--temporal`, `--profile` and the environment (workers/connect.py)."""
    try:
        return target(getattr(args, "temporal", None), getattr(args, "profile", None))
    except ProfileError as error:
        raise AstraeusError(str(error)) from None


async def _connect(args: argparse.Namespace, where: Target | None = None) -> Client:
    """A client of `where` (default: the command's target), with the process's telemetry."""
    telemetry: Telemetry = args.telemetry
    return await connect(where or _target(args), runtime=telemetry.runtime, interceptors=telemetry.interceptors)


def _api(args: argparse.Namespace) -> str | None:
    """The HTTP API to go through: `--api`, else $ASTRAEUS_API_URL, for the verbs that take it; None: Temporal."""
    if "api_url" not in getattr(args, "takes", ()):
        return None
    given: str | None = getattr(args, "api_url", None) or os.environ.get("ASTRAEUS_API_URL") or None
    if given is not None and getattr(args, "temporal", None):
        raise AstraeusError("--api and --temporal: give one (the API reaches Temporal itself)")
    return given


async def _client(args: argparse.Namespace) -> Runs:
    """The verbs over the HTTP API when one is given (`--api URL --token T`), else over Temporal."""
    url = _api(args)
    if url is not None:
        return HttpClient(url, getattr(args, "token", None) or os.environ.get("ASTRAEUS_TOKEN"))
    return await _temporal_client(args)


async def _temporal_client(args: argparse.Namespace) -> AstraeusClient:
    where = _target(args)
    try:
        return AstraeusClient(await _connect(args, where))
    except RuntimeError as error:
        raise Unreachable(f"cannot reach Temporal at {where}: {error}") from None


async def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec(args.file)
    client = await _client(args)
    _, ns, name = (await client.submit(spec)).split("/", 2)  # through the API, a workspace token's namespace
    run = f"{ns}/{name}"  # as the other verbs take it
    value = {"run": run, "id": f"job/{run}", "namespace": ns, "name": name}
    if args.follow:
        print(json.dumps(value) if args.json else f"submitted {run}", flush=True)  # then one event a line
        return await _follow(args, client, ns, name)
    if args.wait:
        print(f"submitted {run}", file=sys.stderr, flush=True)  # stdout has the run's end, as `wait` prints it
        return await _wait(args, client, ns, name)
    emit(args, value, lambda: f"submitted {run}")
    return ExitCode.OK


async def cmd_ls(args: argparse.Namespace) -> int:
    if args.state == DELETED and not args.include_deleted:
        raise AstraeusError(f"--state {DELETED}: only with --include-deleted")
    client = await _client(args)
    page = await client.ls(args.namespace, args.state, limit=args.limit, page=args.page,
                           include_deleted=args.include_deleted)  # fmt: skip
    emit(args, page, lambda: render_runs(page.runs, datetime.now(UTC)))
    if page.next_page and not args.json:
        print(f"more runs: astraeus ls --page {page.next_page}", file=sys.stderr)
    return ExitCode.OK


async def cmd_status(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    status = await (await _client(args)).status(ns, name)
    emit(args, status, lambda: render_status(status))
    return exit_for_state(status.state)


async def cmd_wait(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    return await _wait(args, await _client(args), ns, name)


async def _wait(args: argparse.Namespace, client: Runs, ns: str, name: str) -> int:
    """Wait until the run reaches `--for` (default: until it ends), or `--timeout` passes; print its status and exit
    by it (a run that ended without reaching the state awaited exits by the state it ended in)."""
    until = getattr(args, "for_state", None)
    try:
        async with asyncio.timeout(args.timeout):
            status = await _reached(client, ns, name, until)
    except TimeoutError:
        status = await client.status(ns, name)
        print(f"astraeus: {ns}/{name} is {status.state} after {args.timeout:g} s: {status.reason}", file=sys.stderr)
        return ExitCode.TIMEOUT
    emit(args, status, lambda: render_status(status))
    return exit_for_state(status.state)


async def _reached(client: Runs, ns: str, name: str, until: str | None, poll: float = 0.5) -> Status:
    """The run's status once it is in (or has been in) the state `until`, or has ended."""
    if until is None or until in RUN_TERMINAL:
        return await client.result(ns, name)
    while True:
        described = await client.describe(ns, name)
        status = described.status
        if status.state in (*RUN_TERMINAL, TERMINATED) or any(e.state == until for e in described.history):
            return status
        await asyncio.sleep(poll)


async def cmd_describe(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    described = await (await _client(args)).describe(ns, name, after=args.after, limit=args.limit)
    emit(args, described, lambda: render_describe(described, args.utc))
    _next_page(args, f"{ns}/{name}", [len(h) for h in [described.history, *(t.history for t in described.tasks)]])
    return 0


async def cmd_history(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    described = await (await _client(args)).describe(ns, name, after=args.after, limit=args.limit)
    value = {"run": described.history, "tasks": {t.id: t.history for t in described.tasks}}
    emit(args, value, lambda: render_history(described, args.utc))
    _next_page(args, f"{ns}/{name}", [len(h) for h in [described.history, *(t.history for t in described.tasks)]])
    return 0


async def cmd_events(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    if args.follow and (args.after or args.limit is not None):
        raise AstraeusError("--after and --limit do not apply with --follow (it prints every event)")
    client = await _client(args)
    if not args.follow:
        stream = await client.events(ns, name, after=args.after, limit=args.limit)
        emit(args, stream, lambda: render_events(stream, args.utc))
        _next_page(args, f"{ns}/{name}", [len(stream)])
        return 0
    return await _follow(args, client, ns, name)


def _next_page(args: argparse.Namespace, run: str, sizes: list[int]) -> None:
    """After a full page (`--limit` entries of a history), say on stderr how to ask for the next one."""
    if args.limit is not None and max(sizes) >= args.limit and not args.json:
        after = args.after + args.limit
        command = f"astraeus {args.command} {run} --after {after} --limit {args.limit}"
        print(f"more may follow: {command}", file=sys.stderr)


async def _follow(args: argparse.Namespace, client: Runs, ns: str, name: str) -> int:
    """Print every event as it comes until the run ends; exit by the state it ended in."""
    async for event in client.follow(ns, name):
        print(json.dumps(event.model_dump(mode="json")) if args.json else render_events([event], args.utc), flush=True)
    return exit_for_state((await client.status(ns, name)).state)


async def cmd_cancel(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    status = await (await _client(args)).cancel(ns, name)
    emit(args, status, lambda: f"cancelling {ns}/{name}")
    return 0


async def cmd_delete(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    tombstone = await (await _client(args)).delete(ns, name, by=f"{getpass.getuser()} (astraeus delete)")
    emit(args, tombstone, lambda: f"deleted {ns}/{name} (it was {tombstone.last_state})")
    return 0


async def cmd_stop(args: argparse.Namespace) -> int:
    run, sep, task = args.task.rpartition("/")
    if not sep or not run:
        raise AstraeusError(f"{args.task}: expected RUN/TASK, e.g. hello/worker-0")
    ns, name = split_run(run, args.namespace)
    status = await (await _client(args)).stop(ns, name, task, args.reason)
    emit(args, status, lambda: f"stopping {ns}/{name}/{task}")
    return 0


async def cmd_logs(args: argparse.Namespace) -> int:
    run, sep, task = args.task.rpartition("/")
    if not sep or not run:
        raise AstraeusError(f"{args.task}: expected RUN/TASK, e.g. hello/worker-0")
    if args.tail is not None and args.tail < 1:
        raise AstraeusError(f"--tail {args.tail}: expected a number of lines, 1 or more")
    ns, name = split_run(run, args.namespace)
    client = await _client(args)
    if not args.follow:
        sys.stdout.write(await client.logs(ns, name, task, lines=args.tail or 100_000))
        return ExitCode.OK
    async for text in client.follow_logs(ns, name, task):
        sys.stdout.write(text)
        sys.stdout.flush()
    return ExitCode.OK


ATTACH_OWN_TOKEN_SECONDS = 300  # a token `attach` issues itself, for one command


def _run_and_task(given: str, namespace: str) -> tuple[str, str, str]:
    run, sep, task = given.rpartition("/")
    if not sep or not run:
        raise AstraeusError(f"{given}: expected RUN/TASK, e.g. hello/worker-0")
    ns, name = split_run(run, namespace)
    return ns, name, task


async def cmd_interactive_token(args: argparse.Namespace) -> int:
    """Print a new token for the worker's current attempt (on stdout alone, for `T=$(...)`), and until when."""
    ns, name, task = _run_and_task(args.task, args.namespace)
    token, expires = await (await _temporal_client(args)).interactive_token(ns, name, task, args.ttl)
    print(token)
    print(f"astraeus: a token for {ns}/{name}/{task} until {expires:%Y-%m-%d %H:%M:%S} UTC", file=sys.stderr)
    return ExitCode.OK


async def cmd_attach(args: argparse.Namespace) -> int:
    """Run a command (default: a shell reading this input) in a running worker, and exit with its code."""
    ns, name, task = _run_and_task(args.task, args.namespace)
    argv = args.argv
    client = await _temporal_client(args)
    token = args.session_token or os.environ.get("ASTRAEUS_INTERACTIVE_TOKEN")
    if not token:  # one of our own, for this command only
        token, _ = await client.interactive_token(ns, name, task, ATTACH_OWN_TOKEN_SECONDS)
    stdin = sys.stdin.read() if args.stdin or not argv else ""
    done = await client.attach(ns, name, task, token, argv or ["sh"], stdin, args.timeout)
    sys.stdout.write(done.stdout)
    sys.stdout.flush()
    sys.stderr.write(done.stderr)
    if done.cut:
        kept = SESSION_OUTPUT_MAX_BYTES // 1024
        print(f"astraeus: the command's output was cut to its last {kept} KiB", file=sys.stderr)
    return done.exit_code


async def cmd_nodes(args: argparse.Namespace) -> int:
    if args.verb != "ls":
        return await cmd_node_verb(args)
    views = await (await _client(args)).nodes()
    emit(args, views, lambda: render_nodes(views))
    return 0


async def cmd_node_verb(args: argparse.Namespace) -> int:
    from workers.admin import node_verb

    if not args.name:
        raise AstraeusError(f"nodes {args.verb}: name the machine")
    if args.verb == "data-location":
        return await cmd_data_location(args)
    if args.path is not None:
        raise AstraeusError(f"nodes {args.verb}: takes no PATH")
    view = await node_verb((await _temporal_client(args)).temporal, args.name, args.verb, args.reason)
    done = {"cordon": "cordoned", "uncordon": "uncordoned", "remove": "removed"}[args.verb]
    emit(args, view, lambda: f"{done} {args.name}")
    return 0


async def cmd_data_location(args: argparse.Namespace) -> int:
    """`nodes data-location NAME PATH` chooses where the machine keeps copies of drives; without PATH, shows it."""
    from workers.admin import render_data, set_data_location

    client = await _temporal_client(args)
    if args.path is None:
        view = next((v for v in await client.nodes() if v.name == args.name), None)
        if view is None:
            raise NotFound(f"no machine named {args.name}")
    else:
        view = await set_data_location(client.temporal, args.name, args.path)
    emit(args, view, lambda: render_data(view))
    return 0


async def cmd_drive(args: argparse.Namespace) -> int:
    from workers.admin import create_drive, drives, remove_drive, render_drives

    temporal = (await _temporal_client(args)).temporal
    if args.verb != "ls" and not args.name:
        raise AstraeusError(f"drive {args.verb}: name the drive")
    if args.verb == "create":
        given = {"machine": args.machine, "size_bytes": args.size, "source": args.source}
        missing = [f"--{k.removesuffix('_bytes')}" for k, v in given.items() if v is None]
        given["site"] = args.site
        if missing:
            raise AstraeusError(f"drive create {args.name}: give {', '.join(missing)}")
        try:
            new = NewDrive(name=args.name, **given)
        except ValidationError as error:
            raise AstraeusError(f"drive create {args.name}:\n{format_errors(error)}") from None
        listed = await create_drive(temporal, new)
    elif args.verb == "rm":
        listed = await remove_drive(temporal, args.name)
    else:
        listed = await drives(temporal)
    emit(args, listed, lambda: render_drives(listed))
    return 0


async def cmd_quota(args: argparse.Namespace) -> int:
    from workers.admin import quotas, remove_quota, render_quotas, set_quota

    temporal = (await _temporal_client(args)).temporal
    if args.verb != "ls" and not args.namespace:
        raise AstraeusError(f"quota {args.verb}: name the namespace")
    if args.verb == "set":
        try:
            quota = Quota(namespace=args.namespace, gpus=args.gpus, cpu=args.cpu, memory_bytes=args.memory_bytes,
                          pools=tuple(args.pool))  # fmt: skip
        except ValidationError as error:
            raise AstraeusError(f"quota set {args.namespace}:\n{format_errors(error)}") from None
        listed = await set_quota(temporal, quota)
    elif args.verb == "rm":
        listed = await remove_quota(temporal, args.namespace)
    else:
        listed = await quotas(temporal)
    emit(args, listed, lambda: render_quotas(listed))
    return 0


async def cmd_token(args: argparse.Namespace) -> int:
    from workers.admin import create_token, render_tokens, revoke_token, tokens

    temporal = (await _temporal_client(args)).temporal
    if args.verb == "create":
        if (args.namespace is None) == (not args.admin):
            raise AstraeusError("token create: name the workspace (NAMESPACE), or give --admin")
        if args.namespace is not None:
            try:
                Quota(namespace=args.namespace)  # the same rule as a spec's namespace
            except ValidationError as error:
                raise AstraeusError(f"token create {args.namespace}:\n{format_errors(error)}") from None
        secret, token = await create_token(temporal, args.namespace, args.note or "")
        emit(args, {"token": secret, **token.model_dump(mode="json", exclude={"sha256"})}, lambda: secret)
        return 0
    if args.verb == "revoke":
        if not args.namespace:
            raise AstraeusError("token revoke: name the token's id (astraeus token ls)")
        listed = await revoke_token(temporal, args.namespace)
    else:
        listed = await tokens(temporal)
    shown = [t.model_dump(mode="json", exclude={"sha256"}) for t in listed]
    emit(args, shown, lambda: render_tokens(listed))
    return 0


CA_DIR_HELP = (
    "the cluster CA's directory, its key readable by its owner only (default $ASTRAEUS_CA_DIR, else .astraeus/ca)"
)


def ca_dir(given: str | None) -> Path:
    """--ca-dir, else $ASTRAEUS_CA_DIR, else .astraeus/ca: where the control plane keeps the cluster CA."""
    from activities.control import DEFAULT_CA_DIR

    return given_path(given or os.environ.get("ASTRAEUS_CA_DIR") or str(DEFAULT_CA_DIR))


async def cmd_ca(args: argparse.Namespace) -> int:
    from activities.identity import CA_CERT, ClusterCA

    ca = ClusterCA(ca_dir(args.ca_dir))
    try:
        if args.action == "init":
            made = ca.ensure()
            print(f"{'made' if made else 'kept'} the cluster CA in {ca.directory} (its certificate: "
                  f"{ca.directory / CA_CERT})")  # fmt: skip
            return 0
        if not (ca.directory / CA_CERT).exists():
            raise AstraeusError(f"no cluster CA in {ca.directory}: `astraeus ca init` makes one (so does the control "
                                "plane, when it issues its first identity)")  # fmt: skip
        print(ca.certificate_pem().decode(), end="")
    except OSError as error:
        raise AstraeusError(f"--ca-dir {ca.directory}: {error}") from None
    return 0


async def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(JobSpec.model_json_schema(), indent=2))
    return 0


async def cmd_completion(args: argparse.Namespace) -> int:
    print(shtab.complete(parser(), shell=args.shell), end="")
    return 0


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


# ---- parser -----------------------------------------------------------------------------------------------------

# Options every verb that uses them takes before or after its name: `astraeus --temporal X ls` as `astraeus ls
# --temporal X`. Each is declared on the top parser and on the verbs it applies to (there with a suppressed default,
# so that a verb's parser does not overwrite what was given before the verb).
GLOBAL_HELP = {
    "temporal": "Temporal frontend HOST:PORT (default $ASTRAEUS_TEMPORAL, else the profile's, else 127.0.0.1:7233)",
    "profile": "the Temporal connection profile: address, namespace, TLS, API key, as the temporal CLI reads it "
    "(default $TEMPORAL_PROFILE, else default)",
    "settings": "YAML file overriding the spec's timers and defaults",
    "json": "print JSON",
    "utc": "show times in UTC (default: this machine's zone, marked)",
    "api_url": "go through the HTTP API at this URL instead of Temporal, e.g. http://127.0.0.1:7245 (default "
    "$ASTRAEUS_API_URL)",
    "token": "the API token (default $ASTRAEUS_TOKEN); with --api",
}
THROUGH_API = {"submit", "ls", "status", "wait", "describe", "history", "events", "cancel", "delete", "stop", "logs",
               "nodes"}  # fmt: skip  # the verbs the HTTP API serves


def _global_options(p: argparse.ArgumentParser, names: Sequence[str], *, top: bool) -> None:
    for name in names:
        default = (False if name in ("json", "utc") else None) if top else argparse.SUPPRESS
        if name in ("json", "utc"):
            p.add_argument(f"--{name}", action="store_true", default=default, help=GLOBAL_HELP[name])
        else:
            flag = "--api" if name == "api_url" else f"--{name}"  # `dev --api` is where it serves one: its own dest
            metavar = "URL" if name == "api_url" else None
            action = p.add_argument(flag, dest=name, default=default, metavar=metavar, help=GLOBAL_HELP[name])
            if name == "settings":
                action.complete = shtab.FILE  # type: ignore[attr-defined]  # shtab reads it


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="astraeus", description=__doc__)
    top.add_argument("--version", action="version", version=f"astraeus {version()}")
    _global_options(top, list(GLOBAL_HELP), top=True)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, handler: Handler, help: str, *, process: bool = False, read: bool = False) -> Any:
        p = sub.add_parser(name, help=help, description=help)
        takes = [
            *(["temporal"] if name not in ("schema", "completion", "ca") else []),
            *(["profile"] if name not in ("schema", "completion", "dev", "ca") else []),  # dev starts its own Temporal
            *(["settings"] if process else []),
            *(["json", "utc"] if read else []),
            *(["api_url", "token"] if name in THROUGH_API else []),
        ]
        _global_options(p, takes, top=False)
        p.set_defaults(handler=handler, takes=takes)
        if process:
            what = "serve Prometheus metrics there, the Temporal SDK's and Astraeus's (default: off)"
            p.add_argument("--metrics", metavar="HOST:PORT", help=what)
        return p

    def machine_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--gpus", help="declare GPUs, e.g. 8xH100-80GB (default: read them with NVML)")
        p.add_argument("--cpus", type=float, help="CPU cores to offer (default: all)")
        p.add_argument("--memory-bytes", type=byte_size, help="memory to offer, e.g. 64GiB (default: all)")

    def run_arg(p: argparse.ArgumentParser) -> None:
        p.add_argument("run", help="NAME, NAMESPACE/NAME or job/NAMESPACE/NAME")
        p.add_argument("-n", "--namespace", default="default")

    def wait_flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--timeout", type=seconds, help="give up after this many seconds (exit 7)")

    dev = command("dev", cmd_dev, "the embedded default: Temporal dev server, control plane, scheduler, agents",
                  process=True)  # fmt: skip
    dev.add_argument("--data-dir", default=".astraeus", help="where the database, logs and workers live")
    dev.add_argument("--port", type=int, default=7233, help="Temporal frontend port")
    dev.add_argument("--ui-port", type=int, default=8233, help="Temporal UI port")
    dev.add_argument("--nodes", type=int, default=1, help="local machines to start")
    dev.add_argument("--runtime", choices=["process", "docker"], default="process", help="how workers run")
    dev.add_argument(
        "--api",
        metavar="HOST:PORT",
        help="serve the HTTP API and the console there (default "
        "127.0.0.1:7245); it prints the console's address, which signs you in once, and an admin token",
    )
    dev.add_argument("--no-api", action="store_true", help="serve neither the HTTP API nor the console")
    dev.add_argument("--docker-host", help="the Docker engine (default $DOCKER_HOST, else its socket)")
    machine_flags(dev)

    control = command("control", cmd_control, "the control plane: hosts every run's and machine's workflow",
                      process=True)  # fmt: skip
    control.add_argument("--ca-dir", help=CA_DIR_HELP)
    control.add_argument("--scheduler", help="the scheduler's door HOST:PORT (default $ASTRAEUS_SCHEDULER or "
                         "127.0.0.1:7244)")  # fmt: skip
    scheduler = command("scheduler", cmd_scheduler, "the scheduler service: places workers on machines", process=True)
    scheduler.add_argument("--listen", help="HOST:PORT of its door for the control plane (default "
                           "$ASTRAEUS_SCHEDULER or 127.0.0.1:7244)")  # fmt: skip
    api = command("api", cmd_api, "the HTTP API: runs, workers, machines and quotas, for bearer tokens", process=True)
    api.add_argument("--listen", help="HOST:PORT to serve it on (default $ASTRAEUS_API, else 127.0.0.1:7245)")
    api.add_argument("--openapi", action="store_true", help="print its OpenAPI document and exit")
    api.add_argument("--scheduler", help="the scheduler's door HOST:PORT, for the machines' free room (default "
                     "$ASTRAEUS_SCHEDULER or 127.0.0.1:7244; its token from $ASTRAEUS_SCHEDULER_TOKEN)")  # fmt: skip
    api.add_argument("--temporal-ui", metavar="URL", help="the Temporal UI, for the console's links to each run's "
                     "workflow, e.g. http://127.0.0.1:8233 (default $ASTRAEUS_TEMPORAL_UI; else no links)")  # fmt: skip
    agent = command("agent", cmd_agent, "a node agent: runs this machine's workers", process=True)
    agent.add_argument("--name", required=True, help="this machine's name")
    agent.add_argument("--data-dir", default=".astraeus/agent", help="where workers' files and logs live")
    agent.add_argument("--label", action="append", default=[], help="KEY=VALUE label of this machine")
    agent.add_argument("--runtime", choices=["process", "docker"], default="process", help="how workers run")
    agent.add_argument("--docker-host", help="the Docker engine (default $DOCKER_HOST, else its socket)")
    agent.add_argument(
        "--host-path",
        action="append",
        default=[],
        help="a host path drives may mount (repeatable; default: any but system paths)",
    )
    agent.add_argument("--pool", action="append", default=[], help="a pool this machine belongs to (repeatable)")
    agent.add_argument("--accept-label", action="append", default=[],
                       help="KEY=VALUE: take only workers that select this label (repeatable)")  # fmt: skip
    agent.add_argument("--rack", help=f"this machine's rack (the label {RACK_LABEL})")
    agent.add_argument("--site", help="this machine's site (where its drives' data is)")
    agent.add_argument("--address", default="127.0.0.1",
                       help="where other machines reach this one (a gang's MASTER_ADDR)")  # fmt: skip
    agent.add_argument("--rdma-port", action="append", default=[],
                       help="declare an RDMA port NAME:LINK:SPEED[:FABRIC], e.g. mlx5_0:InfiniBand:200:ib-0 "
                            "(repeatable; default: read them from sysfs)")  # fmt: skip
    agent.add_argument("--ib-fabric", help="the fabric its InfiniBand ports are on, e.g. ib-0 (default: the subnet "
                                           "prefix of each port)")  # fmt: skip
    agent.add_argument("--capability-note", action="append", default=[],
                       help="NAME=WHY: why a capability is missing, shown in the reason instead of the agent's own "
                            "(repeatable)")  # fmt: skip
    agent.add_argument("--sandbox-runtime", default="runsc",
                       help="the engine's runtime that sandboxes workers (gVisor; default runsc): with it registered, "
                            "the machine runs sandboxed workers")  # fmt: skip
    agent.add_argument("--outbound-policy", action="store_true",
                       help="enforce workers' outbound policies: each such worker in a network namespace of its own "
                            "behind a firewall (process runtime; needs root, ip and iptables)")  # fmt: skip
    agent.add_argument("--tool-gateway", help="URL of the tool gateway this machine serves its workers "
                                              "(ASTRAEUS_TOOL_GATEWAY)")  # fmt: skip
    agent.add_argument("--model-server", help="URL of the model server this machine serves its workers "
                                              "(ASTRAEUS_MODEL_SERVER, once it answers)")  # fmt: skip
    agent.add_argument("--no-interactive-sessions", dest="interactive_sessions", action="store_false",
                       help="host no interactive sessions: a worker asking an interactive token fails here "
                            "(\"Interactive token: <why>\")")  # fmt: skip
    agent.add_argument("--data-location", help="where data of drives held elsewhere is copied (its free space is "
                                               "reported)")  # fmt: skip
    agent.add_argument("--external-ports", metavar="FIRST-LAST",
                       help="the machine's ports it assigns to workers' external access, e.g. 30000-30099")  # fmt: skip
    agent.add_argument("--refuse-runs", metavar="WHY",
                       help="the machine takes no new runs, and placement says why: \"machine does not accept runs: "
                            "WHY\" (its own setting, kept by its agent; cordon is the cluster's)")  # fmt: skip
    agent.add_argument("--mesh-endpoint", metavar="HOST:PORT",
                       help="join the node network's mesh between machines: where other machines reach this one's "
                            "WireGuard (UDP; it listens on PORT). Without it the machine is in no mesh")  # fmt: skip
    agent.add_argument("--mesh-netns", metavar="NAME",
                       help="the network namespace its Docker engine runs in, where its WireGuard interface goes "
                            "(default: the agent's own)")  # fmt: skip
    agent.add_argument("--sysfs", default="/sys", help="where the host's /sys is (an agent in a container)")
    agent.add_argument("--procfs", default="/proc", help="where the host's /proc is (an agent in a container)")
    machine_flags(agent)

    submit = command("submit", cmd_submit, "submit a run spec (YAML)", read=True)
    submit.add_argument("file").complete = shtab.FILE
    then = submit.add_mutually_exclusive_group()
    then.add_argument("--wait", action="store_true", help="then wait until the run ends; exit by its state")
    then.add_argument(
        "--follow", "-f", action="store_true", help="then print its events until it ends; exit by its state"
    )
    wait_flags(submit)
    ls = command("ls", cmd_ls, "list runs: open ones first, then the latest to end", read=True)
    ls.add_argument("-n", "--namespace", help="only this namespace")
    ls.add_argument("--state", choices=[*RUN_STATES, DELETED], help="only runs in this state")
    ls.add_argument("--limit", type=positive, default=100, help="at most this many runs (default 100)")
    ls.add_argument("--page", help="the next page: the token a previous ls printed")
    ls.add_argument("--include-deleted", action="store_true", help="also deleted runs, as Deleted, after the others")
    wait = command("wait", cmd_wait, "wait until a run ends (or reaches --for STATE); exit by its state", read=True)
    run_arg(wait)
    wait.add_argument("--for", dest="for_state", choices=RUN_STATES, help="the state to wait for (default: its end)")
    wait_flags(wait)
    for name, handler, help in (
        ("status", cmd_status, "a run's state and reason"),
        ("describe", cmd_describe, "a run, its workers and why they wait"),
        ("history", cmd_history, "every change of a run and of its workers"),
        ("events", cmd_events, "a run's events, oldest first"),
        ("cancel", cmd_cancel, "cancel a run: stop every worker"),
        ("delete", cmd_delete, "delete a run: cancel it, remove its workers' files and logs, free its name"),
    ):
        p = command(name, handler, help, read=True)
        run_arg(p)
        if name == "events":
            p.add_argument("--follow", "-f", action="store_true", help="keep printing until the run ends")
        if name in ("describe", "history", "events"):
            of = "events" if name == "events" else "entries of each history"
            p.add_argument("--after", type=natural, default=0, metavar="N", help=f"skip the first N {of} (a page)")
            p.add_argument("--limit", type=positive, metavar="N", help=f"at most N {of} (default: every one)")
    stop = command("stop", cmd_stop, "stop one worker", read=True)
    stop.add_argument("task", help="RUN/TASK, e.g. hello/worker-0")
    stop.add_argument("--reason", help='why (default "Stopped by scheduler")')
    stop.add_argument("-n", "--namespace", default="default")
    logs = command("logs", cmd_logs, "print a worker's output (stdout and stderr)")
    logs.add_argument("task", help="RUN/TASK, e.g. hello/worker-0")
    how = logs.add_mutually_exclusive_group()
    how.add_argument("--tail", type=int, help="only the last N lines")
    how.add_argument("--follow", "-f", action="store_true", help="keep printing new output until the worker ends")
    logs.add_argument("-n", "--namespace", default="default")
    about = "issue a token with which a person runs commands in a worker (capabilities.interactive_token)"
    token = command("interactive-token", cmd_interactive_token, about)
    token.add_argument("task", help="RUN/TASK, e.g. hello/worker-0")
    token.add_argument("--ttl", type=int, default=3600, metavar="SECONDS",
                       help="how long it is valid (default 3600; at most a week; never past the attempt)")  # fmt: skip
    token.add_argument("-n", "--namespace", default="default")
    attach = command("attach", cmd_attach, "run a command in a running worker (capabilities.interactive_token)")
    attach.add_argument("task", help="RUN/TASK, e.g. hello/worker-0")
    attach.add_argument("--token", dest="session_token", help="a token from `astraeus interactive-token` (default "
                                        "$ASTRAEUS_INTERACTIVE_TOKEN, else one issued for this command)")  # fmt: skip
    attach.add_argument("--stdin", "-i", action="store_true",
                        help="send this input to the command (always: a shell run without a command)")  # fmt: skip
    attach.add_argument("--timeout", type=float, default=60, help="stop the command after this many seconds")
    attach.add_argument("-n", "--namespace", default="default")
    attach.add_argument("argv", nargs="*", metavar="-- COMMAND",
                        help="the command and its arguments (default: sh, reading this input)")  # fmt: skip
    about = "list machines; cordon, uncordon or remove one; data-location NAME [PATH]: where it keeps drives' copies"
    nodes = command("nodes", cmd_nodes, about, read=True)
    verbs = ["ls", "cordon", "uncordon", "remove", "data-location"]
    nodes.add_argument("verb", nargs="?", choices=verbs, default="ls")
    nodes.add_argument("name", nargs="?", help="the machine (cordon, uncordon, remove, data-location)")
    nodes.add_argument("path", nargs="?", help="data-location: a directory of the machine")
    nodes.add_argument("--reason", help="why (cordon, remove)")
    quota = command("quota", cmd_quota, "namespace quotas: set NAMESPACE [limits], rm NAMESPACE, ls", read=True)
    quota.add_argument("verb", choices=["set", "rm", "ls"])
    quota.add_argument("namespace", nargs="?")
    quota.add_argument("--gpus", type=int, help="GPUs its workers may hold at once (default: no limit)")
    quota.add_argument("--cpu", type=float, help="CPU cores its workers may hold at once")
    quota.add_argument("--memory-bytes", type=byte_size, help="memory its workers may hold at once, e.g. 512GiB")
    quota.add_argument("--pool", action="append", default=[], help="the only pools whose machines it may use")
    drive = command("drive", cmd_drive, "the catalogue of drives: create NAME --machine --size --source [--site], "
                    "ls, rm NAME", read=True)  # fmt: skip
    drive.add_argument("verb", choices=["create", "ls", "rm"])
    drive.add_argument("name", nargs="?", help="the drive (create, rm)")
    drive.add_argument("--site", help="create: the site whose machines may copy it (default: any machine)")
    drive.add_argument("--machine", help="create: the machine that holds its data")
    drive.add_argument("--size", type=byte_size, help="create: room a copy needs, e.g. 200GiB")
    drive.add_argument("--source", help="create: its files, a directory its site's machines read (path or file://)")
    token = command("token", cmd_token, "the HTTP API's tokens: create NAMESPACE (or --admin), ls, revoke ID",
                    read=True)  # fmt: skip
    token.add_argument("verb", choices=["create", "ls", "revoke"])
    token.add_argument("namespace", nargs="?", metavar="NAMESPACE|ID", help="create: the workspace; revoke: the id")
    token.add_argument("--admin", action="store_true", help="create an admin token: every workspace, and changes "
                       "to machines and quotas")  # fmt: skip
    token.add_argument("--note", help="create: what the token is for, shown by token ls")
    command("schema", cmd_schema, "print the run spec's JSON Schema")
    ca = command("ca", cmd_ca, "the cluster CA that issues workers' identities: init makes it, show prints its "
                 "certificate (what a worker's peers trust)")  # fmt: skip
    ca.add_argument("action", choices=["init", "show"])
    ca.add_argument("--ca-dir", help=CA_DIR_HELP)
    completion = command("completion", cmd_completion, "print a shell completion script: bash or zsh")
    completion.add_argument("shell", choices=["bash", "zsh"])
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """The console script. Exits with os._exit: the Temporal client's Rust threads can crash a finalizing
    interpreter (temporalio/sdk-python#300), so the process skips finalization once its output is flushed."""
    code = run(argv)
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        code = _closed_pipe()
    sys.stderr.flush()
    os._exit(code)


def _command_after_dashes(argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """`attach ... -- COMMAND`: the arguments before `--`, and the command after it (None without one), which
    argparse does not read past a verb's options."""
    given = list(argv)
    if "--" not in given or "attach" not in given[: given.index("--")]:
        return given, None
    cut = given.index("--")
    return given[:cut], given[cut + 1 :]


def run(argv: Sequence[str] | None = None) -> int:
    top = parser()
    given, command = _command_after_dashes(sys.argv[1:] if argv is None else argv)
    args = top.parse_args(given)
    if command is not None:
        args.argv = [*args.argv, *command]
    for name in GLOBAL_HELP:
        if getattr(args, name) not in (None, False) and name not in args.takes:
            top.error(f"--{'api' if name == 'api_url' else name} does not apply to {args.command}")
    if args.command in SERVICES:
        collector.tune()
    level = logging.INFO if args.command in SERVICES else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args.telemetry = Telemetry()
    try:
        args.telemetry = set_up(args.command, getattr(args, "metrics", None))
        handler: Handler = args.handler
        return asyncio.run(handler(args))
    except TelemetryError as error:
        print(f"astraeus: {error}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    except AstraeusError as error:
        print(f"astraeus: {error}", file=sys.stderr)
        return _exit_for_error(error)
    except RPCError as error:
        if error.status != RPCStatusCode.UNAVAILABLE:
            raise
        print(f"astraeus: Temporal at {_target(args)} stopped answering: {error}", file=sys.stderr)
        return ExitCode.UNREACHABLE
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        return _closed_pipe()
    finally:
        args.telemetry.flush()


def _exit_for_error(error: AstraeusError) -> ExitCode:
    if isinstance(error, NotFound):
        return ExitCode.NOT_FOUND
    if isinstance(error, Unreachable):
        return ExitCode.UNREACHABLE
    return ExitCode.BAD_INPUT


def _closed_pipe() -> ExitCode:
    """The reader went away (`astraeus history RUN | head -1`): nothing more can be shown, and nothing is wrong with
    the command. Point stdout at /dev/null so that flushing what is left does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return ExitCode.CLOSED_PIPE


if __name__ == "__main__":
    main()
