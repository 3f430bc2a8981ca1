"""The verbs of runs and their workers: submit, ls, status, wait, describe, history, events, cancel, delete, stop,
logs, interactive-token and attach."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import sys
from datetime import UTC, datetime

from workers.commands.inputs import load_spec, split_run
from workers.commands.options import Runs, emit, runs_client, temporal_client
from workers.errors import AstraeusError
from workers.exits import ExitCode, exit_for_state
from workers.render import render_describe, render_events, render_history, render_runs, render_status
from workflows.domain.run.status import RUN_TERMINAL, Status
from workflows.domain.run.views import TERMINATED
from workflows.domain.tombstones import DELETED
from workflows.messages import SESSION_OUTPUT_MAX_BYTES


async def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec(args.file)
    client = await runs_client(args)
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
    client = await runs_client(args)
    page = await client.ls(args.namespace, args.state, limit=args.limit, page=args.page,
                           include_deleted=args.include_deleted)  # fmt: skip
    emit(args, page, lambda: render_runs(page.runs, datetime.now(UTC)))
    if page.next_page and not args.json:
        print(f"more runs: astraeus ls --page {page.next_page}", file=sys.stderr)
    return ExitCode.OK


async def cmd_status(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    status = await (await runs_client(args)).status(ns, name)
    emit(args, status, lambda: render_status(status))
    return exit_for_state(status.state)


async def cmd_wait(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    return await _wait(args, await runs_client(args), ns, name)


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
    described = await (await runs_client(args)).describe(ns, name, after=args.after, limit=args.limit)
    emit(args, described, lambda: render_describe(described, args.utc))
    _next_page(args, f"{ns}/{name}", [len(h) for h in [described.history, *(t.history for t in described.tasks)]])
    return 0


async def cmd_history(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    described = await (await runs_client(args)).describe(ns, name, after=args.after, limit=args.limit)
    value = {"run": described.history, "tasks": {t.id: t.history for t in described.tasks}}
    emit(args, value, lambda: render_history(described, args.utc))
    _next_page(args, f"{ns}/{name}", [len(h) for h in [described.history, *(t.history for t in described.tasks)]])
    return 0


async def cmd_events(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    if args.follow and (args.after or args.limit is not None):
        raise AstraeusError("--after and --limit do not apply with --follow (it prints every event)")
    client = await runs_client(args)
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
    status = await (await runs_client(args)).cancel(ns, name)
    emit(args, status, lambda: f"cancelling {ns}/{name}")
    return 0


async def cmd_delete(args: argparse.Namespace) -> int:
    ns, name = split_run(args.run, args.namespace)
    tombstone = await (await runs_client(args)).delete(ns, name, by=f"{getpass.getuser()} (astraeus delete)")
    emit(args, tombstone, lambda: f"deleted {ns}/{name} (it was {tombstone.last_state})")
    return 0


async def cmd_stop(args: argparse.Namespace) -> int:
    run, sep, task = args.task.rpartition("/")
    if not sep or not run:
        raise AstraeusError(f"{args.task}: expected RUN/TASK, e.g. hello/worker-0")
    ns, name = split_run(run, args.namespace)
    status = await (await runs_client(args)).stop(ns, name, task, args.reason)
    emit(args, status, lambda: f"stopping {ns}/{name}/{task}")
    return 0


async def cmd_logs(args: argparse.Namespace) -> int:
    run, sep, task = args.task.rpartition("/")
    if not sep or not run:
        raise AstraeusError(f"{args.task}: expected RUN/TASK, e.g. hello/worker-0")
    if args.tail is not None and args.tail < 1:
        raise AstraeusError(f"--tail {args.tail}: expected a number of lines, 1 or more")
    ns, name = split_run(run, args.namespace)
    client = await runs_client(args)
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
    token, expires = await (await temporal_client(args)).interactive_token(ns, name, task, args.ttl)
    print(token)
    print(f"astraeus: a token for {ns}/{name}/{task} until {expires:%Y-%m-%d %H:%M:%S} UTC", file=sys.stderr)
    return ExitCode.OK


async def cmd_attach(args: argparse.Namespace) -> int:
    """Run a command (default: a shell reading this input) in a running worker, and exit with its code."""
    ns, name, task = _run_and_task(args.task, args.namespace)
    argv = args.argv
    client = await temporal_client(args)
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
