"""`make test` runs pytest on two processes, and tests/conftest.py says which tests may run at the same time: each
module is a group of its own, but the modules that use what this machine has one of share a group."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import MACHINE_GROUP, ONE_PER_MACHINE, ONE_PER_MACHINE_FIXTURES, ByGroup, group_of

REPO = Path(__file__).resolve().parents[1]
# Prints the fixtures of each test collected, and runs none.
PROBE = """
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        print("FIXTURES", item.nodeid.split("::")[0], *getattr(item, "fixturenames", ()))
    config.hook.pytest_deselected(items=items[:])
    items[:] = []
"""


class Worker:
    """What pytest-xdist's scheduling asks of a worker process: it records the tests it is sent."""

    def __init__(self, name: str) -> None:
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[int] = []

    def send_runtest_some(self, indexes: list[int]) -> None:
        self.sent += indexes

    def shutdown(self) -> None:
        self.shutting_down = True


def test_a_module_is_a_group_and_what_the_machine_has_one_of_is_one() -> None:
    assert group_of("tests/domain/test_job.py::test_the_hello_path") == "tests/domain/test_job.py"
    assert group_of("tests/workflows/test_node_workflow.py::test_x[a::b]") == "tests/workflows/test_node_workflow.py"
    assert group_of("tests/integration/test_one_cluster.py::test_the_tour") == MACHINE_GROUP
    assert group_of("tests/activities/test_docker_runtime.py::test_a_container[x]") == MACHINE_GROUP


def test_the_scheduling_sends_a_group_whole_to_one_process(
    pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pytestconfig.option, "tx", ["2*popen"])  # as `-n 2` sets it
    tests = [
        "tests/activities/test_docker_runtime.py::test_a",
        "tests/domain/test_job.py::test_a",
        "tests/domain/test_job.py::test_b",
        "tests/integration/test_api.py::test_a",
        "tests/integration/test_one_cluster.py::test_a",
        "tests/integration/test_api.py::test_b",
        "tests/integration/test_mesh.py::test_a",
    ]
    scheduling = ByGroup(pytestconfig)
    workers = [Worker("gw0"), Worker("gw1")]
    for worker in workers:
        scheduling.add_node(worker)  # type: ignore[arg-type]
        scheduling.add_node_collection(worker, tests)  # type: ignore[arg-type]

    scheduling.schedule()

    sent = [{tests[i] for i in worker.sent} for worker in workers]
    assert sorted(set().union(*sent)) == sorted(tests)  # every test, once
    assert sum(map(len, sent)) == len(tests)
    for group in ({tests[0], tests[4], tests[6]}, {tests[1], tests[2]}, {tests[3], tests[5]}):
        assert [group <= s for s in sent].count(True) == 1, (group, sent)


def test_every_module_whose_tests_use_the_machines_one_of_a_kind_fixtures_is_in_its_group(tmp_path: Path) -> None:
    (tmp_path / "fixture_probe.py").write_text(PROBE)
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "fixture_probe", "tests"],
        cwd=REPO,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    # Every module collected (an error in one would hide its fixtures), and no test run: the probe deselected them all.
    assert collected.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, collected.stdout[-2000:] + collected.stderr
    users: set[str] = set()
    for line in collected.stdout.splitlines():
        if line.startswith("FIXTURES "):
            module, *fixtures = line.split()[1:]
            if set(fixtures) & set(ONE_PER_MACHINE_FIXTURES):
                users.add(module)

    assert "tests/activities/test_docker_runtime.py" in users, collected.stdout[-2000:]
    assert sorted(users - ONE_PER_MACHINE.keys()) == []


@pytest.mark.parametrize(("flags", "processes"), [((), "2"), (("TEST_PROCESSES=1",), "1")])
@pytest.mark.parametrize(("target", "marks"), [("test", ""), ("integration", "integration and ")])
def test_make_test_runs_on_two_processes_then_the_tests_marked_alone_on_one(
    target: str, marks: str, flags: tuple[str, ...], processes: str
) -> None:
    command = ["make", "-n", "-C", str(REPO), target, *flags]
    planned = subprocess.run(command, capture_output=True, text=True, check=True)

    pytest_lines = [line.split(" -m pytest ", 1)[1] for line in planned.stdout.splitlines() if "-m pytest" in line]
    assert pytest_lines == [f"-q -n {processes} -m '{marks}not alone'", f"-q -m '{marks}alone'"], planned.stdout


def test_the_tests_that_keep_both_cores_busy_are_marked_alone() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "alone", "tests"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    alone = sorted(line for line in listed.stdout.splitlines() if "::" in line)
    assert alone == [
        "tests/test_bench_burst.py::test_a_tiny_burst_prints_its_figures_and_exits_0",
        "tests/test_chaos.py::test_an_agent_cut_off_from_temporal_never_leaves_two_live_copies_of_a_worker",
        "tests/test_chaos.py::test_every_fault_in_turn_loses_no_run_starts_no_worker_twice_and_holds_no_gpu_twice",
        "tests/test_chaos.py::test_temporal_away_longer_than_a_lease_stops_no_worker_and_loses_no_exit",
    ], listed.stdout[-2000:]
