"""The CLI's offline parts: the spec's schema, settings files, and bad input named clearly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from workers.cli import DISTRIBUTION, parser, run
from workers.commands.inputs import load_settings, load_spec, split_run
from workers.errors import AstraeusError
from workers.exits import ExitCode, exit_for_state
from workers.worker_io import new_output

ROOT = Path(__file__).parent.parent


def test_schema_prints_the_run_specs_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "JobSpec"
    assert schema["additionalProperties"] is False
    assert set(schema["$defs"]["GroupSpec"]["properties"]) >= {"command", "replicas", "gpus", "restart_policy"}
    assert schema["$defs"]["Network"]["properties"]["mesh"] == {
        "default": False,
        "description": "Joins the node network: an address on its machine's subnet, where the run's other workers "
        "reach it, by name (<worker>.<run>.<workspace>) from its own machine, by address from others through the "
        "mesh (docker machines; a run not kept on one machine goes only to machines in the mesh; a gang's groups ask "
        "it all or none, and meet at the leader's address there).",
        "title": "Mesh",
        "type": "boolean",
    }


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_a_valid_run_spec(path: Path) -> None:
    load_spec(str(path))


def test_the_example_settings_file_loads() -> None:
    settings = load_settings(str(ROOT / "deploy" / "settings.example.yaml"))
    assert settings.backoff_base_seconds == 10
    assert (settings.node_subnet_range, settings.node_subnet_prefix) == ("10.200.0.0/16", 24)


def test_a_settings_file_with_an_unknown_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("backoff_base_seconds: 1\nbackof_cap_seconds: 2\n")
    with pytest.raises(AstraeusError) as error:
        load_settings(str(path))
    assert str(error.value) == f"--settings {path}:\nbackof_cap_seconds: unknown field"


def test_a_settings_file_whose_timer_would_overflow_a_date_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.yaml"
    path.write_text("backoff_cap_seconds: 1.0e+300\nrestart_reset_seconds: .inf\n")
    with pytest.raises(AstraeusError) as error:
        load_settings(str(path))
    assert str(error.value) == (
        f"--settings {path}:\nbackoff_cap_seconds: Input should be less than or equal to 86400\n"
        "restart_reset_seconds: Input should be less than or equal to 31536000"
    )


def test_submit_of_an_invalid_spec_names_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ngroups: [{name: w, command: [x], gpus: -1}]\n")
    assert run(["submit", str(path), "--temporal", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == (
        f"astraeus: {path}: invalid run spec:\ngroups.0.gpus: Input should be greater than or equal to 0\n"
    )


def test_the_readmes_commands_for_running_apart_parse() -> None:
    """They point at hosts that do not exist here: each is at least a command with flags the CLI has."""
    import shlex

    from workers.cli import parser

    text = (ROOT / "README.md").read_text()
    block = text.split("## Running it for real", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    commands = [shlex.split(line.split("#", 1)[0]) for line in block.strip().splitlines()]
    assert [c[1] for c in commands] == ["control", "scheduler", "agent"]
    for command in commands:
        assert command[0] == "astraeus"
        parser().parse_args(command[1:])


def test_a_mesh_endpoint_that_is_not_host_port_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """(tests/integration/test_mesh.py starts agents with --mesh-endpoint and --mesh-netns for real.)"""
    assert run(["agent", "--name", "m1", "--mesh-endpoint", "192.0.2.1", "--temporal", "127.0.0.1:1"]) == 2
    assert capsys.readouterr().err == "astraeus: --mesh-endpoint 192.0.2.1 is not HOST:PORT\n"


# ---- scripting: as a user runs it --------------------------------------------------------------------------------

ASTRAEUS = str(Path(sys.executable).parent / "astraeus")
NOWHERE = "127.0.0.1:1"  # nothing listens there


def astraeus(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ASTRAEUS, *args], capture_output=True, text=True, timeout=60, env=env)


def test_version_is_the_installed_distributions() -> None:
    result = astraeus("--version")
    assert (result.returncode, result.stdout) == (0, f"astraeus {metadata.version(DISTRIBUTION)}\n")


@pytest.mark.parametrize(
    "args",
    [
        ["--temporal", NOWHERE, "status", "hello"],
        ["status", "hello", "--temporal", NOWHERE],
        ["--json", "ls", "--temporal", NOWHERE],
    ],
    ids=["global option before the verb", "after the verb", "json before, temporal after"],
)
def test_a_temporal_that_cannot_be_reached_exits_4_wherever_the_option_is_given(args: list[str]) -> None:
    result = astraeus(*args)
    assert result.returncode == ExitCode.UNREACHABLE == 4
    assert result.stderr.startswith(f"astraeus: cannot reach Temporal at {NOWHERE}: ")


def test_an_option_before_a_verb_it_does_not_apply_to_is_refused() -> None:
    result = astraeus("--json", "schema")
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == "astraeus: error: --json does not apply to schema"
    result = astraeus("--settings", "s.yaml", "ls")
    assert result.stderr.splitlines()[-1] == "astraeus: error: --settings does not apply to ls"


def test_settings_given_before_a_process_verb_are_read(tmp_path: Path) -> None:
    missing = tmp_path / "none.yaml"
    result = astraeus("--settings", str(missing), "scheduler", "--temporal", NOWHERE)
    assert result.returncode == 2
    assert result.stderr.startswith(f"astraeus: --settings {missing}: [Errno 2] No such file or directory")


def test_an_unknown_state_is_refused_naming_the_states() -> None:
    result = astraeus("ls", "--state", "Done", "--temporal", NOWHERE)
    assert result.returncode == ExitCode.BAD_INPUT == 2
    assert result.stderr.splitlines()[-1] == (
        "astraeus ls: error: argument --state: invalid choice: 'Done' (choose from 'Pending', 'Starting', 'Running', "
        "'Completed', 'Failed', 'Cancelled', 'Terminated', 'Deleted')"
    )
    assert astraeus("wait", "hello", "--for", "Done").returncode == 2
    assert "argument --timeout: '-1': expected seconds, 0 or more" in astraeus("wait", "hello", "--timeout=-1").stderr
    assert "argument --limit: '0': expected a number, 1 or more" in astraeus("ls", "--limit", "0").stderr


def test_an_invalid_spec_exits_2_before_connecting(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\ngroups: [{name: w}]\n")
    result = astraeus("submit", str(path), "--wait", "--temporal", NOWHERE)
    assert (result.returncode, result.stderr.splitlines()[-1]) == (2, "groups.0.command: Field required")


def test_sizes_are_taken_with_units() -> None:
    args = parser().parse_args(["quota", "set", "ml", "--memory-bytes", "64GiB"])
    assert args.memory_bytes == 64 * 2**30
    assert parser().parse_args(["agent", "--name", "a", "--memory-bytes", "1073741824"]).memory_bytes == 2**30
    result = astraeus("quota", "set", "ml", "--memory-bytes", "lots")
    assert result.returncode == 2
    assert "argument --memory-bytes: 'lots': expected a size, e.g. 68719476736, 64GiB or 512MiB" in result.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_prints_a_script_that_knows_every_verb(shell: str) -> None:
    result = astraeus("completion", shell)
    assert result.returncode == 0
    for word in ("submit", "wait", "logs", "completion", "--follow", "--temporal"):
        assert word in result.stdout
    if shell == "bash":
        loaded = subprocess.run(
            ["bash", "-c", f"{result.stdout}\ncomplete -p astraeus"], capture_output=True, text=True
        )
        assert loaded.returncode == 0, loaded.stderr
        assert "astraeus" in loaded.stdout
    else:
        assert result.stdout.startswith("#compdef astraeus")


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    """`astraeus schema | head -1`: the reader has gone before the output is written."""
    read, write = os.pipe()
    os.close(read)
    try:
        process = subprocess.run([ASTRAEUS, "schema"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (process.returncode, process.stderr) == (ExitCode.CLOSED_PIPE, "")


# ---- pure parts -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "code"),
    [("Completed", 0), ("Running", 0), ("Pending", 0), ("Failed", 1), ("Cancelled", 5), ("Terminated", 6)],
)
def test_a_run_state_maps_to_its_exit_code(state: str, code: int) -> None:
    assert exit_for_state(state) == code


@pytest.mark.parametrize(
    ("given", "expected"),
    [("hello", ("default", "hello")), ("ml/hello", ("ml", "hello")), ("job/ml/hello", ("ml", "hello"))],
    ids=["a name", "as submit prints it", "the workflow id"],
)
def test_a_run_is_named_as_submit_prints_it(given: str, expected: tuple[str, str]) -> None:
    assert split_run(given, "default") == expected


def test_a_run_named_with_too_many_parts_is_refused() -> None:
    with pytest.raises(AstraeusError, match="expected NAME, NAMESPACE/NAME or job/NAMESPACE/NAME"):
        split_run("a/b/c/d", "default")


@pytest.mark.parametrize(
    ("shown", "text", "new"),
    [
        ("", "a\n", "a\n"),
        ("a\n", "a\nb\n", "b\n"),
        ("a\nb", "a\nbc\n", "c\n"),
        ("a\nb\n", "b\nc\n", "c\n"),
        ("a\nb\n", "x\ny\n", "x\ny\n"),
        ("a\nb\n", "a\nb\n", ""),
    ],
    ids=["first read", "a line added", "a line finished", "the window slid", "more than a window", "nothing new"],
)
def test_following_a_log_prints_only_what_is_new(shown: str, text: str, new: str) -> None:
    assert new_output(shown, text) == new


def test_an_agent_that_refuses_runs_must_say_why_before_connecting() -> None:
    result = astraeus("agent", "--name", "m0", "--refuse-runs", " ", "--temporal", NOWHERE)
    assert (result.returncode, result.stderr.splitlines()[-1]) == (
        2,
        "astraeus: --refuse-runs: say why the machine takes no new runs",
    )


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ("30000", "--external-ports 30000: expected FIRST-LAST, e.g. 30000-30099"),
        ("30010-30000", "--external-ports 30010-30000: 30010-30000: the first port is after the last"),
        ("0-10", "--external-ports 0-10: first: Input should be greater than or equal to 1"),
    ],
)
def test_an_agents_external_ports_are_a_range_of_ports(given: str, error: str) -> None:
    result = astraeus("agent", "--name", "m0", "--external-ports", given, "--temporal", NOWHERE)
    assert (result.returncode, result.stderr.splitlines()[-1]) == (2, f"astraeus: {error}")


def test_ca_init_makes_the_cluster_ca_once_and_ca_show_prints_its_certificate(tmp_path: Path) -> None:
    where = tmp_path / "ca"
    missing = astraeus("ca", "show", "--ca-dir", str(where))
    assert (missing.returncode, missing.stderr.strip()) == (
        2,
        f"astraeus: no cluster CA in {where}: `astraeus ca init` makes one (so does the control plane, when it "
        "issues its first identity)",
    )
    made = astraeus("ca", "init", "--ca-dir", str(where))
    assert made.stdout == f"made the cluster CA in {where} (its certificate: {where / 'ca.pem'})\n"
    kept = astraeus("ca", "init", "--ca-dir", str(where), env={**os.environ, "ASTRAEUS_CA_DIR": "/nowhere"})
    assert kept.stdout == f"kept the cluster CA in {where} (its certificate: {where / 'ca.pem'})\n"
    shown = astraeus("ca", "show", env={**os.environ, "ASTRAEUS_CA_DIR": str(where)})
    assert shown.stdout == (where / "ca.pem").read_text() and shown.stdout.startswith("-----BEGIN CERTIFICATE-----")
