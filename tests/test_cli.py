"""The CLI's offline parts: the spec's schema, settings files, and bad input named clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workers.cli import load_settings, load_spec, run
from workers.client import AstraeusError

ROOT = Path(__file__).parent.parent


def test_schema_prints_the_run_specs_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "JobSpec"
    assert schema["additionalProperties"] is False
    assert set(schema["$defs"]["GroupSpec"]["properties"]) >= {"command", "replicas", "gpus", "restart_policy"}


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_a_valid_run_spec(path: Path) -> None:
    load_spec(str(path))


def test_the_example_settings_file_loads() -> None:
    settings = load_settings(str(ROOT / "deploy" / "settings.example.yaml"))
    assert settings.backoff_base_seconds == 10


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
