"""Connecting to Temporal: where (a `temporal` CLI profile, `TEMPORAL_*` variables, or flags), and every client
with the pydantic data converter."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client, Interceptor
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.envconfig import ClientConfigProfile, ClientConfigTLS, DataSource
from temporalio.runtime import Runtime
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from workflows.contracts import SA_NAMESPACE, SA_NODES, SA_PRIORITY, SA_STATE

DEFAULT_ADDRESS = "127.0.0.1:7233"
TEMPORAL_NAMESPACE = "default"  # the namespace when no profile or TEMPORAL_NAMESPACE names one
SEARCH_ATTRIBUTES = {
    SA_NAMESPACE: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    SA_STATE: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    SA_PRIORITY: IndexedValueType.INDEXED_VALUE_TYPE_INT,
    SA_NODES: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST,
}


class ProfileError(Exception):
    """A connection profile that cannot be used (no such profile, a malformed file, a certificate that cannot be
    read); the message names it."""


@dataclass(frozen=True)
class Target:
    """Where and how a process connects to Temporal."""

    address: str = DEFAULT_ADDRESS
    namespace: str = TEMPORAL_NAMESPACE
    tls: bool | TLSConfig = False
    api_key: str | None = None
    rpc_metadata: Mapping[str, str] = field(default_factory=dict)
    profile: str | None = None  # the profile it came from, as errors name it

    def __str__(self) -> str:
        return self.address if self.namespace == TEMPORAL_NAMESPACE else f"{self.address} (namespace {self.namespace})"


def target(flag: str | None = None, profile: str | None = None, environ: Mapping[str, str] | None = None) -> Target:
    """Where to connect: the address from `--temporal`, else $ASTRAEUS_TEMPORAL, else the profile (its file's
    `address`, overridden by $TEMPORAL_ADDRESS), else 127.0.0.1:7233; the namespace, TLS and API key from the
    profile and the `TEMPORAL_*` variables, as the `temporal` CLI reads them (`--profile`, else $TEMPORAL_PROFILE,
    else "default"; the file $TEMPORAL_CONFIG_FILE, else ~/.config/temporalio/temporal.toml)."""
    env = dict(os.environ if environ is None else environ)
    name = profile or env.get("TEMPORAL_PROFILE")
    loaded = _load_profile(profile, env)
    tls: bool | TLSConfig = False
    if loaded.api_key is not None:
        tls = True  # Temporal Cloud's API keys go over TLS, as the SDK's own loader does
    if loaded.tls is not None:
        tls = _tls(loaded.tls, name)
    return Target(
        address=flag or env.get("ASTRAEUS_TEMPORAL") or loaded.address or DEFAULT_ADDRESS,
        namespace=loaded.namespace or TEMPORAL_NAMESPACE,
        tls=tls,
        api_key=loaded.api_key,
        rpc_metadata=dict(loaded.grpc_meta),
        profile=name,
    )


def _load_profile(profile: str | None, env: dict[str, str]) -> ClientConfigProfile:
    where = env.get("TEMPORAL_CONFIG_FILE")
    if where and not Path(where).expanduser().is_file():
        raise ProfileError(f"TEMPORAL_CONFIG_FILE={where}: no such file")
    shown = f"profile {profile or env.get('TEMPORAL_PROFILE') or 'default'}"
    try:
        # Strict: a misspelt key (`adress`) is refused rather than silently ignored.
        return ClientConfigProfile.load(profile, override_env_vars=env, config_file_strict=True)
    except Exception as error:  # the SDK's ConfigError, raised from its Rust core
        file = where or "~/.config/temporalio/temporal.toml"
        raise ProfileError(f"{shown} ({file}): {str(error).rstrip()}") from None


def _tls(tls: ClientConfigTLS, profile: str | None) -> bool | TLSConfig:
    """The profile's TLS settings, each file read now, so that a path that cannot be read is named before any
    connection is tried."""
    if tls.disabled:
        return False
    return TLSConfig(
        domain=tls.server_name,
        server_root_ca_cert=_read(tls.server_root_ca_cert, "server CA certificate", profile),
        client_cert=_read(tls.client_cert, "client certificate", profile),
        client_private_key=_read(tls.client_private_key, "client key", profile),
    )


def _read(source: DataSource | None, what: str, profile: str | None) -> bytes | None:
    if source is None:
        return None
    if isinstance(source, Path):
        try:
            return source.expanduser().read_bytes()
        except OSError as error:
            raise ProfileError(f"profile {profile or 'default'}: {what} {source}: {error.strerror or error}") from None
    return source.encode() if isinstance(source, str) else source


async def connect(
    where: str | Target,
    *,
    wait: timedelta = timedelta(seconds=0),
    runtime: Runtime | None = None,
    interceptors: Sequence[Interceptor] = (),
) -> Client:
    """Connect to `where` (an address: its default namespace, no TLS), retrying up to `wait` while the server
    starts."""
    chosen = Target(address=where) if isinstance(where, str) else where
    deadline = asyncio.get_running_loop().time() + wait.total_seconds()
    while True:
        try:
            return await Client.connect(
                chosen.address,
                namespace=chosen.namespace,
                tls=chosen.tls,
                api_key=chosen.api_key,
                rpc_metadata=chosen.rpc_metadata,
                data_converter=pydantic_data_converter,
                runtime=runtime,
                interceptors=interceptors,
            )
        except RuntimeError:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def ensure_search_attributes(client: Client) -> None:
    """Register Astraeus's search attributes in the client's namespace where they are missing (idempotent)."""
    try:
        have = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace)
        )
        missing = {k: v for k, v in SEARCH_ATTRIBUTES.items() if k not in have.custom_attributes}
    except RPCError as error:
        if error.status != RPCStatusCode.UNIMPLEMENTED:  # the time-skipping test server cannot list them
            raise
        missing = dict(SEARCH_ATTRIBUTES)
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
        )
