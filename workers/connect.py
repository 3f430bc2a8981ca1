"""Connecting to Temporal: every client uses the pydantic data converter."""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode

from workflows.messages import SA_NAMESPACE, SA_NODES, SA_PRIORITY, SA_STATE

DEFAULT_ADDRESS = "127.0.0.1:7233"
TEMPORAL_NAMESPACE = "default"
SEARCH_ATTRIBUTES = {
    SA_NAMESPACE: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    SA_STATE: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    SA_PRIORITY: IndexedValueType.INDEXED_VALUE_TYPE_INT,
    SA_NODES: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST,
}


def address(flag: str | None) -> str:
    """`--temporal HOST:PORT`, else $ASTRAEUS_TEMPORAL, else the embedded default's."""
    return flag or os.environ.get("ASTRAEUS_TEMPORAL") or DEFAULT_ADDRESS


async def connect(target: str, *, wait: timedelta = timedelta(seconds=0)) -> Client:
    """Connect, retrying up to `wait` while the server starts."""
    deadline = asyncio.get_running_loop().time() + wait.total_seconds()
    while True:
        try:
            return await Client.connect(target, namespace=TEMPORAL_NAMESPACE, data_converter=pydantic_data_converter)
        except RuntimeError:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            await asyncio.sleep(0.2)


async def ensure_search_attributes(client: Client) -> None:
    """Register Astraeus's search attributes where they are missing (idempotent)."""
    try:
        have = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=TEMPORAL_NAMESPACE)
        )
        missing = {k: v for k, v in SEARCH_ATTRIBUTES.items() if k not in have.custom_attributes}
    except RPCError as error:
        if error.status != RPCStatusCode.UNIMPLEMENTED:  # the time-skipping test server cannot list them
            raise
        missing = dict(SEARCH_ATTRIBUTES)
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=TEMPORAL_NAMESPACE, search_attributes=missing)
        )
