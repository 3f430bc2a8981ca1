"""Connection profiles: where each process connects, from flags, `ASTRAEUS_TEMPORAL`, the `temporal` CLI's TOML
profiles and its `TEMPORAL_*` variables; and a profile that cannot be used, named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from temporalio.service import TLSConfig

from tests.tls import SERVER_NAME, Certs, make_certs
from workers.connect import ProfileError, Target, target
from workers.exits import ExitCode

ASTRAEUS = str(Path(sys.executable).parent / "astraeus")

PROFILES = """
[profile.default]
address = "file-default:7233"

[profile.prod]
address = "prod.example:7233"
namespace = "research"
api_key = "secret-key"
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "temporal.toml"
    path.write_text(PROFILES)
    return path


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [
        ("flag:1", {"ASTRAEUS_TEMPORAL": "astraeus:2", "TEMPORAL_ADDRESS": "temporal:3"}, "flag:1"),
        (None, {"ASTRAEUS_TEMPORAL": "astraeus:2", "TEMPORAL_ADDRESS": "temporal:3"}, "astraeus:2"),
        (None, {"TEMPORAL_ADDRESS": "temporal:3"}, "temporal:3"),
        (None, {}, "file-default:7233"),
    ],
    ids=[
        "the flag comes first",
        "then ASTRAEUS_TEMPORAL",
        "then TEMPORAL_ADDRESS over the profile's file",
        "then the profile's file",
    ],
)
def test_the_address_is_taken_in_order(flag: str | None, env: dict[str, str], expected: str, config: Path) -> None:
    assert target(flag, environ={"TEMPORAL_CONFIG_FILE": str(config), **env}).address == expected


def test_with_nothing_configured_it_connects_as_before(tmp_path: Path) -> None:
    nothing = {"HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}  # no ~/.config/temporalio/temporal.toml
    assert target(environ=nothing) == Target(address="127.0.0.1:7233", namespace="default", tls=False)


def test_a_profile_names_the_namespace_and_its_api_key_turns_tls_on(config: Path) -> None:
    chosen = target(profile="prod", environ={"TEMPORAL_CONFIG_FILE": str(config)})
    assert (chosen.address, chosen.namespace, chosen.api_key, chosen.tls) == (
        "prod.example:7233",
        "research",
        "secret-key",
        True,
    )
    assert str(chosen) == "prod.example:7233 (namespace research)"


def test_temporal_profile_and_temporal_namespace_are_read(config: Path) -> None:
    env = {"TEMPORAL_CONFIG_FILE": str(config), "TEMPORAL_PROFILE": "prod", "TEMPORAL_NAMESPACE": "other"}
    assert (target(environ=env).address, target(environ=env).namespace) == ("prod.example:7233", "other")


def tls_profile(certs: Certs, **overrides: str) -> str:
    paths = {
        "server_ca_cert_path": str(certs.ca),
        "client_cert_path": str(certs.client_cert),
        "client_key_path": str(certs.client_key),
    } | overrides
    lines = "\n".join(f'{key} = "{value}"' for key, value in paths.items())
    return f'[profile.tls]\naddress = "127.0.0.1:7233"\n[profile.tls.tls]\nserver_name = "{SERVER_NAME}"\n{lines}\n'


def test_a_profiles_tls_settings_reach_the_connection(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    config = tmp_path / "temporal.toml"
    config.write_text(tls_profile(certs))
    tls = target(profile="tls", environ={"TEMPORAL_CONFIG_FILE": str(config)}).tls
    assert tls == TLSConfig(
        domain=SERVER_NAME,
        server_root_ca_cert=certs.ca.read_bytes(),
        client_cert=certs.client_cert.read_bytes(),
        client_private_key=certs.client_key.read_bytes(),
    )
    assert tls.client_private_key is not None and b"PRIVATE KEY" in tls.client_private_key


def test_temporal_tls_false_turns_a_profiles_tls_off(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    config = tmp_path / "temporal.toml"
    config.write_text(tls_profile(certs))
    assert target(profile="tls", environ={"TEMPORAL_CONFIG_FILE": str(config), "TEMPORAL_TLS": "false"}).tls is False


def test_a_certificate_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    config = tmp_path / "temporal.toml"
    missing = tmp_path / "nowhere" / "client.pem"
    config.write_text(tls_profile(certs, client_cert_path=str(missing)))
    with pytest.raises(ProfileError) as error:
        target(profile="tls", environ={"TEMPORAL_CONFIG_FILE": str(config)})
    assert str(error.value) == f"profile tls: client certificate {missing}: No such file or directory"


@pytest.mark.parametrize(
    ("text", "profile", "expected"),
    [
        (PROFILES, "staging", "profile staging ({config}): Profile 'staging' not found"),
        ("[profile.prod\naddress = 1\n", "prod", "profile prod ({config}): Configuration loading error: TOML parse"),
        ('[profile.prod]\nadress = "x:1"\n', "prod", "profile prod ({config}): Configuration loading error: TOML"),
    ],
    ids=["no such profile", "a malformed file", "a misspelt key"],
)
def test_a_profile_that_cannot_be_used_is_named(text: str, profile: str, expected: str, tmp_path: Path) -> None:
    config = tmp_path / "temporal.toml"
    config.write_text(text)
    with pytest.raises(ProfileError) as error:
        target(profile=profile, environ={"TEMPORAL_CONFIG_FILE": str(config)})
    assert str(error.value).startswith(expected.format(config=config))


def test_a_config_file_that_is_not_there_is_named(tmp_path: Path) -> None:
    with pytest.raises(ProfileError) as error:
        target(environ={"TEMPORAL_CONFIG_FILE": str(tmp_path / "none.toml")})
    assert str(error.value) == f"TEMPORAL_CONFIG_FILE={tmp_path / 'none.toml'}: no such file"


@pytest.mark.parametrize(
    "args",
    [["ls", "--profile", "staging"], ["--profile", "staging", "status", "hello"], ["control", "--profile", "staging"]],
    ids=["a verb, the option after it", "the option before a verb", "a process"],
)
def test_a_bad_profile_exits_2_naming_it(args: list[str], config: Path) -> None:
    result = subprocess.run(
        [ASTRAEUS, *args], capture_output=True, text=True, timeout=60, env={"TEMPORAL_CONFIG_FILE": str(config)}
    )
    assert result.returncode == ExitCode.BAD_INPUT == 2
    assert result.stderr == f"astraeus: profile staging ({config}): Profile 'staging' not found\n"


def test_dev_starts_its_own_temporal_and_takes_no_profile() -> None:
    result = subprocess.run([ASTRAEUS, "dev", "--profile", "x"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == "astraeus: error: unrecognized arguments: --profile x"
