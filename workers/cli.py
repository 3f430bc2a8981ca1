"""`astraeus`: run the embedded default or its parts, submit runs and read why they are where they are."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from importlib import metadata
from typing import Any

import shtab
from temporalio.service import RPCError, RPCStatusCode

from workers import collector
from workers.commands.admin import cmd_ca, cmd_quota, cmd_token
from workers.commands.inputs import CA_DIR_HELP, RUN_STATES, byte_size, natural, positive, seconds
from workers.commands.machines import cmd_drive, cmd_nodes
from workers.commands.options import GLOBAL_HELP, THROUGH_API, global_options, target_of
from workers.commands.processes import cmd_agent, cmd_api, cmd_control, cmd_dev, cmd_scheduler
from workers.commands.runs import (
    cmd_attach,
    cmd_cancel,
    cmd_delete,
    cmd_describe,
    cmd_events,
    cmd_history,
    cmd_interactive_token,
    cmd_logs,
    cmd_ls,
    cmd_status,
    cmd_stop,
    cmd_submit,
    cmd_wait,
)
from workers.errors import AstraeusError, NotFound, Unreachable
from workers.exits import ExitCode
from workers.telemetry import Telemetry, TelemetryError, set_up
from workflows.domain.constraints import RACK_LABEL
from workflows.domain.spec import JobSpec
from workflows.domain.tombstones import DELETED

DISTRIBUTION = "astraeus-orchestrator"  # whose metadata `--version` reads
SERVICES = ("dev", "control", "scheduler", "agent", "api")  # the long-running commands (logged, collector tuned)

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


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


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="astraeus", description=__doc__)
    top.add_argument("--version", action="version", version=f"astraeus {version()}")
    global_options(top, list(GLOBAL_HELP), top=True)
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
        global_options(p, takes, top=False)
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
        print(f"astraeus: Temporal at {target_of(args)} stopped answering: {error}", file=sys.stderr)
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
