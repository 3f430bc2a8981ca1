"""The options that every verb which uses them takes: where it connects (`--temporal`, `--profile`, `--api`,
`--token`) and how it prints (`--json`); declared here for the parser, and read here for the verbs."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import shtab
from pydantic import BaseModel
from temporalio.client import Client

from workers.client import AstraeusClient
from workers.connect import ProfileError, Target, connect, target
from workers.errors import AstraeusError, Unreachable
from workers.http_client import HttpClient
from workers.telemetry import Telemetry

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


def global_options(p: argparse.ArgumentParser, names: Sequence[str], *, top: bool) -> None:
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


Runs = AstraeusClient | HttpClient  # the verbs over Temporal, or over the HTTP API (--api)


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


def target_of(args: argparse.Namespace) -> Target:
    """Where this command connects: `--temporal`, `--profile` and the environment (workers/connect.py)."""
    try:
        return target(getattr(args, "temporal", None), getattr(args, "profile", None))
    except ProfileError as error:
        raise AstraeusError(str(error)) from None


async def connect_to(args: argparse.Namespace, where: Target | None = None) -> Client:
    """A client of `where` (default: the command's target), with the process's telemetry."""
    telemetry: Telemetry = args.telemetry
    return await connect(where or target_of(args), runtime=telemetry.runtime, interceptors=telemetry.interceptors)


def _api(args: argparse.Namespace) -> str | None:
    """The HTTP API to go through: `--api`, else $ASTRAEUS_API_URL, for the verbs that take it; None: Temporal."""
    if "api_url" not in getattr(args, "takes", ()):
        return None
    given: str | None = getattr(args, "api_url", None) or os.environ.get("ASTRAEUS_API_URL") or None
    if given is not None and getattr(args, "temporal", None):
        raise AstraeusError("--api and --temporal: give one (the API reaches Temporal itself)")
    return given


async def runs_client(args: argparse.Namespace) -> Runs:
    """The verbs over the HTTP API when one is given (`--api URL --token T`), else over Temporal."""
    url = _api(args)
    if url is not None:
        return HttpClient(url, getattr(args, "token", None) or os.environ.get("ASTRAEUS_TOKEN"))
    return await temporal_client(args)


async def temporal_client(args: argparse.Namespace) -> AstraeusClient:
    where = target_of(args)
    try:
        return AstraeusClient(await connect_to(args, where))
    except RuntimeError as error:
        raise Unreachable(f"cannot reach Temporal at {where}: {error}") from None
