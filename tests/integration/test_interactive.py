"""Interactive sessions with a running worker (`capabilities.interactive_token`), end to end on a real cluster (the
dev server, a control plane, a scheduler and agents as processes, the process runtime): a person issues a token for
a worker, attaches and runs a command in it, and gets its output back; a token of another worker, one that expired
and a worker that did not ask one are refused, each saying why; a machine that hosts no sessions fails the worker
with the spec's "Interactive token: <why>"."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from activities.session_token import public_key
from tests.integration.harness import ASTRAEUS, Cluster
from tests.integration.test_drives import ROOT, readme_commands
from tests.integration.test_identity import histories, payloads

pytestmark = pytest.mark.integration

MACHINE = ["--cpus", "2", "--memory-bytes", str(2**30)]
SLEEPER = {"name": "w", "cpu": 1, "command": ["sleep", "300"], "env": {"GREETING": "hello"}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("interactive"))
    try:
        c.start({"open": MACHINE, "closed": [*MACHINE, "--no-interactive-sessions"]})
        yield c
    finally:
        c.stop()


def submit(cluster: Cluster, tmp_path: Path, name: str, machine: str, **group: Any) -> None:
    spec = {"name": name, "groups": [SLEEPER | group], "node_selection": {"names": [machine]}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(path))


def astraeus(
    cluster: Cluster, *args: str, stdin: str = "", token: str | None = None
) -> subprocess.CompletedProcess[str]:
    """A command as a person types it: the cluster's address in the environment, so a trailing `-- COMMAND` is the
    command's own."""
    env = {**os.environ, "ASTRAEUS_TEMPORAL": cluster.address}
    env.pop("ASTRAEUS_INTERACTIVE_TOKEN", None)
    if token is not None:
        env["ASTRAEUS_INTERACTIVE_TOKEN"] = token
    return subprocess.run([ASTRAEUS, *args], input=stdin, capture_output=True, text=True, timeout=60, env=env)


def test_a_person_attaches_to_a_worker_with_a_token_and_runs_commands(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "shell", "open", capabilities={"interactive_token": True})
    submit(cluster, tmp_path, "other", "open", capabilities={"interactive_token": True})
    cluster.wait_state("shell", "Running")
    cluster.wait_state("other", "Running")

    issued = astraeus(cluster, "interactive-token", "shell/w-0")
    assert issued.returncode == 0, issued.stderr
    token = issued.stdout.strip()
    assert token.startswith("astraeus-it-") and issued.stdout == f"{token}\n"
    assert issued.stderr.startswith("astraeus: a token for default/shell/w-0 until ")

    hello = astraeus(cluster, "attach", "shell/w-0", "--token", token, "--", "echo", "hello")
    assert (hello.returncode, hello.stdout, hello.stderr) == (0, "hello\n", "")
    shell = astraeus(
        cluster, "attach", "shell/w-0", stdin='echo "$GREETING from $ASTRAEUS_TASK"\nexit 4\n', token=token
    )
    assert (shell.returncode, shell.stdout) == (4, "hello from w-0\n")
    own = astraeus(cluster, "attach", "shell/w-0", "--", "sh", "-c", "echo $ASTRAEUS_JOB")  # a token of its own
    assert (own.returncode, own.stdout) == (0, "shell\n")

    # No history holds the token, the run's nor the sessions' (which hold its public key: the search sees them).
    searched = b"\n".join(payloads(h) for h in histories(cluster, 'WorkflowType = "SessionWorkflow"'))
    searched += b"\n".join(payloads(h) for h in histories(cluster, 'WorkflowId = "job/default/shell"'))
    assert public_key(token).encode() in searched
    assert token.removeprefix("astraeus-it-").encode() not in searched

    wrong = astraeus(cluster, "attach", "other/w-0", "--token", token, "--", "echo", "hello")
    assert (wrong.returncode, wrong.stdout) == (2, "")
    assert wrong.stderr == "astraeus: token refused: it was not issued for worker w-0 (attempt 0)\n"

    short = astraeus(cluster, "interactive-token", "shell/w-0", "--ttl", "1").stdout.strip()
    time.sleep(1.5)
    expired = astraeus(cluster, "attach", "shell/w-0", "--token", short, "--", "echo", "hello")
    assert expired.returncode == 2 and expired.stderr.startswith("astraeus: token refused: it expired at ")

    bad = astraeus(cluster, "attach", "shell/w-0", "--token", "letmein", "--", "echo", "hello")
    assert (bad.returncode, bad.stderr) == (
        2,
        "astraeus: token refused: not an interactive token (it should begin with astraeus-it-)\n",
    )
    cluster.cli("cancel", "shell")
    cluster.cli("cancel", "other")


def test_a_worker_that_asked_no_token_hosts_no_session(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "plain", "open")
    cluster.wait_state("plain", "Running")
    refused = astraeus(cluster, "attach", "plain/w-0", "--", "echo", "hello")
    assert (refused.returncode, refused.stderr) == (
        2,
        "astraeus: worker w-0 (attempt 0) on open hosts no interactive sessions (its group does not ask "
        "capabilities.interactive_token, or this attempt was not set up here)\n",
    )
    cluster.cli("cancel", "plain")


def test_a_machine_that_hosts_no_sessions_fails_the_worker(cluster: Cluster, tmp_path: Path) -> None:
    submit(cluster, tmp_path, "closed", "closed", restart_policy="Never", capabilities={"interactive_token": True})
    described = cluster.wait_state("closed", "Failed", "Completed")
    assert described["status"]["reason"] == (
        "Worker w-0 failed on closed: Interactive token: this machine hosts no interactive sessions (its agent was "
        "started with --no-interactive-sessions)"
    )


def test_the_readmes_session_commands_run_as_written(tmp_path_factory: pytest.TempPathFactory) -> None:
    """On a machine named as `astraeus dev` names it, in a shell pointed at the cluster by $ASTRAEUS_TEMPORAL, each
    command of the README's "Interactive sessions" as it writes it, with the output its comments say."""
    commands = readme_commands("## Interactive sessions")
    assert commands == [
        "astraeus submit examples/shell.yaml",
        "astraeus wait shell --for Running",
        "astraeus attach shell/shell-0 -- echo hello",
        "T=$(astraeus interactive-token shell/shell-0 --ttl 600)",
        "astraeus attach shell/shell-0 --token \"$T\" -- sh -c 'echo $GREETING from $ASTRAEUS_TASK'",
        "echo 'echo $GREETING; pwd' | astraeus attach shell/shell-0 --token \"$T\"",
        "astraeus cancel shell",
    ]
    c = Cluster(tmp_path_factory.mktemp("readme-sessions"))
    try:
        c.start({"local-0": MACHINE})
        env = {**os.environ, "ASTRAEUS_TEMPORAL": c.address, "PATH": f"{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"}
        env.pop("ASTRAEUS_INTERACTIVE_TOKEN", None)
        ran = subprocess.run(
            ["bash", "-ec", "\n".join(commands)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert ran.returncode == 0, ran.stderr
        lines = ran.stdout.splitlines()
        assert (lines[-5:-2], lines[-1]) == (["hello", "hello from shell-0", "hello"], "cancelling default/shell")
        assert Path(lines[-2]).name == "default.shell.shell-0.0"  # the worker's own directory
    finally:
        c.stop()
