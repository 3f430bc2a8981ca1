"""`make test` (CI) allows no skip: under REQUIRE_ALL_SUITES=1, which the Makefile sets, a suite that cannot run
here fails and says why it skipped (the hooks in tests/conftest.py); run by hand without it, it may still skip."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[1]
# Skips as the docker, NVML and memory-cgroup suites make them: from a session fixture, a mark, and a test's body.
SUITES = """
import pytest

@pytest.fixture(scope="session")
def docker_engine():
    pytest.skip("dockerd is not installed (make test installs Debian's docker.io)")

def test_containers_run(docker_engine):
    pass

@pytest.mark.skipif(True, reason="this machine has no NVML library")
def test_gpus_are_read():
    pass

def test_memory_is_limited():
    pytest.skip("memory cgroups need root: no memory controller")

@pytest.mark.xfail(reason="a known bug")
def test_a_known_bug():
    assert False
"""


def with_our_hooks(pytester: pytest.Pytester, **files: str) -> pytest.Pytester:
    """A project of its own holding `files`, run with tests/conftest.py's hooks."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest("from tests.conftest import pytest_make_collect_report, pytest_runtest_makereport")
    pytester.makepyfile(**files)
    return pytester


@pytest.fixture
def suites(pytester: pytest.Pytester) -> pytest.Pytester:
    return with_our_hooks(pytester, test_suites=SUITES)


def test_a_suite_that_skips_fails_under_make_test_and_says_why(
    suites: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REQUIRE_ALL_SUITES", "1")

    result = suites.runpytest_inprocess()

    result.assert_outcomes(failed=1, errors=2, xfailed=1)  # a skip in setup (mark, fixture) is an error
    allows_no_skip = "skipped, and REQUIRE_ALL_SUITES=1 (make test) allows no skip: "
    result.stdout.fnmatch_lines_random(
        [
            f"{allows_no_skip}dockerd is not installed (make test installs Debian's docker.io) (*test_suites.py:*)",
            f"{allows_no_skip}this machine has no NVML library (*test_suites.py:*)",
            f"{allows_no_skip}memory cgroups need root: no memory controller (*test_suites.py:*)",
        ]
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED


@pytest.mark.parametrize("value", [None, "0"], ids=["by hand", "make test REQUIRE_ALL_SUITES=0"])
def test_a_suite_that_cannot_run_here_still_skips_when_not_required(
    suites: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("REQUIRE_ALL_SUITES", raising=False)
    else:
        monkeypatch.setenv("REQUIRE_ALL_SUITES", value)

    result = suites.runpytest_inprocess()

    result.assert_outcomes(skipped=3, xfailed=1)
    assert result.ret == pytest.ExitCode.OK


def test_a_module_skipped_while_collected_fails_under_make_test(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REQUIRE_ALL_SUITES", "1")
    project = with_our_hooks(
        pytester, test_docker="import pytest\ndocker = pytest.importorskip('no_docker_sdk_here')\n"
    )

    result = project.runpytest_inprocess()

    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*allows no skip: could not import 'no_docker_sdk_here'*"])


@pytest.mark.parametrize("target", ["test", "integration"])
def test_make_test_and_make_integration_allow_no_skip(target: str) -> None:
    planned = subprocess.run(["make", "-n", "-C", str(REPO), target], capture_output=True, text=True, check=True)

    pytest_lines = [line for line in planned.stdout.splitlines() if "-m pytest" in line]
    assert pytest_lines, planned.stdout
    assert all(line.startswith("REQUIRE_ALL_SUITES=1 ") for line in pytest_lines), pytest_lines
