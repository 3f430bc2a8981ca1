"""The deploy artefacts match the CLI. What cannot run here (no registry for the base images, no Kubernetes) is
validated: the compose file by Debian's `docker-compose config`, the manifests against Kubernetes' schemas, the
Dockerfile by Docker's own parser; and every `astraeus` command line in them, systemd units included, is parsed by
the CLI's own parser, every ASTRAEUS_ variable they set is one the code reads, and the addresses agree."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import dockerfile
import kubernetes_validate
import pytest
import yaml

from workers.cli import parser
from workers.commands.inputs import load_settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
KUBERNETES = "1.32.0"
SERVER_COMMANDS = {"control", "scheduler", "agent", "api"}
SOURCES = [path for top in ("workflows", "activities", "workers") for path in (ROOT / top).rglob("*.py")]
CODE = "\n".join(path.read_text() for path in SOURCES)


def parses(argv: list[str], where: str) -> Any:
    """`argv` (after `astraeus`) as the CLI reads it; a flag or value it does not take fails the test."""
    assert argv and argv[0] in SERVER_COMMANDS, f"{where}: {argv} is not a command of a long-lived part"
    try:
        return parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"{where}: `astraeus {shlex.join(argv)}` is not a command line astraeus takes")


def read_variables(names: list[str], where: str) -> None:
    for name in names:
        if name.startswith("ASTRAEUS_"):
            assert f'"{name}"' in CODE, f"{where}: {name} is read nowhere in the code"


# ---- the image -------------------------------------------------------------------------------------------------


def test_the_image_installs_the_package_without_its_test_tools_and_runs_astraeus() -> None:
    steps = dockerfile.parse_file(str(DEPLOY / "Dockerfile"))
    by_name: dict[str, list[Any]] = {}
    for step in steps:
        by_name.setdefault(step.cmd, []).append(step)
    (base,) = by_name["FROM"]
    assert re.fullmatch(r"python:3\.1[1-9][.\w-]*", base.value[0]), base.value  # a pinned Python of 3.11 or later
    for copy in by_name["COPY"]:
        for source in copy.value[:-1]:
            assert (ROOT / source).exists(), f"the image copies {source}, which the checkout lacks"
    installs = [step.value[0] for step in by_name["RUN"] if "pip install" in step.value[0]]
    assert installs and all(" . " in f"{line} " and "[test]" not in line for line in installs), installs
    (entrypoint,) = by_name["ENTRYPOINT"]
    assert entrypoint.json and list(entrypoint.value) == ["astraeus"]
    assert "7244" in by_name["EXPOSE"][0].value  # the scheduler's door
    ignored = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    assert "*" in ignored and {"!workflows", "!activities", "!workers"} <= set(ignored)


# ---- compose ---------------------------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def interpolate(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)(?::[-?]([^}]*))?\}", lambda m: env.get(m[1], m[2] or ""), value)


def test_the_compose_file_passes_docker_compose_config_and_needs_a_scheduler_token() -> None:
    tool = shutil.which("docker-compose")
    assert tool, "docker-compose is missing: `make engine` installs Debian's (apt-get install docker-compose)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTRAEUS_")}
    check = [tool, "-f", str(DEPLOY / "compose.yaml"), "config", "-q"]
    done = subprocess.run(check, capture_output=True, text=True, env={**env, "ASTRAEUS_SCHEDULER_TOKEN": "s3cret"})
    assert done.returncode == 0, done.stderr
    refused = subprocess.run(check, capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "set ASTRAEUS_SCHEDULER_TOKEN to a secret of your own" in refused.stderr


def test_the_compose_services_are_the_cluster_and_their_commands_are_the_clis() -> None:
    services = compose()["services"]
    assert {"postgresql", "temporal", "temporal-ui", "scheduler", "control", "api", "agent"} <= set(services)
    assert services["temporal"]["environment"]["DB"] == "postgres12"
    env = {"ASTRAEUS_SCHEDULER_TOKEN": "s3cret"}
    parts = {}
    for name in ("scheduler", "control", "api", "agent"):
        service = services[name]
        assert service["build"] == {"context": "..", "dockerfile": "deploy/Dockerfile"}
        parts[name] = parses([interpolate(word, env) for word in service["command"]], f"compose service {name}")
        read_variables(list(service["environment"]), f"compose service {name}")
        host, port = service["environment"]["ASTRAEUS_TEMPORAL"].split(":")
        assert host in services and f"{port}:{port}" in services[host]["ports"]
    door = parts["scheduler"].listen.split(":")[1]
    assert parts["control"].scheduler == parts["api"].scheduler == f"scheduler:{door}"  # api: the free room
    assert services["control"]["deploy"]["replicas"] >= 2
    assert "replicas" not in services["scheduler"].get("deploy", {})  # exactly one
    api = parts["api"].listen.split(":")[1]
    assert f"{api}:{api}" in services["api"]["ports"]  # published: people and their scripts reach it
    agent = services["agent"]
    assert agent["user"] == "root" and "/var/run/docker.sock:/var/run/docker.sock" in agent["volumes"]
    assert parts["agent"].runtime == "docker" and parts["agent"].address
    assert f"{parts['agent'].data_dir}:{parts['agent'].data_dir}" in agent["volumes"]  # the same path for the engine
    assert agent["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


# ---- Kubernetes ------------------------------------------------------------------------------------------------


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            found[(document["kind"], document["metadata"]["name"])] = document
    return found


def test_the_manifests_pass_kubernetes_schemas_strictly() -> None:
    documents = manifests()
    assert len(documents) >= 6
    for document in documents.values():
        kubernetes_validate.validate(document, KUBERNETES, strict=True)
    misspelt = manifests()[("Deployment", "astraeus-scheduler")]
    misspelt["spec"]["replica"] = misspelt["spec"].pop("replicas")  # the validator does look
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES, strict=True)


def container(document: dict[str, Any]) -> dict[str, Any]:
    (only,) = document["spec"]["template"]["spec"]["containers"]
    return only


def arguments(document: dict[str, Any]) -> list[str]:
    """The container's args with Kubernetes' $(VAR) references filled from its own env."""
    spec = container(document)
    values = {item["name"]: item.get("value", f"<{item['name'].lower()}>") for item in spec.get("env", [])}
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m[1]], word) for word in spec["args"]]


def test_the_manifests_run_one_scheduler_a_scaled_control_plane_and_an_agent_per_gpu_node(tmp_path: Path) -> None:
    documents = manifests()
    scheduler = documents[("Deployment", "astraeus-scheduler")]
    control = documents[("Deployment", "astraeus-control")]
    agents = documents[("DaemonSet", "astraeus-agent")]
    api = documents[("Deployment", "astraeus-api")]
    assert scheduler["spec"]["replicas"] == 1 and scheduler["spec"]["strategy"]["type"] == "Recreate"
    assert control["spec"]["replicas"] >= 2
    pod = agents["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia" and pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["hostNetwork"] is True  # a gang's MASTER_ADDR is the node's address
    parts = {}
    for name, document in (("scheduler", scheduler), ("control", control), ("api", api), ("agent", agents)):
        parts[name] = parses(arguments(document), f"k8s {name}")
        read_variables([item["name"] for item in container(document)["env"]], f"k8s {name}")
        assert container(document)["image"] == compose()["x-astraeus"]["image"]
    door = parts["scheduler"].listen.split(":")[1]
    service = documents[("Service", "astraeus-scheduler")]
    assert [port["port"] for port in service["spec"]["ports"]] == [int(door)]
    assert parts["control"].scheduler == parts["api"].scheduler == f"astraeus-scheduler:{door}"
    door_policy = documents[("NetworkPolicy", "astraeus-scheduler-door")]["spec"]["ingress"][0]["from"]
    allowed = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in door_policy}
    assert allowed == {"control", "api"}  # the door lets in who calls it
    assert (parts["agent"].name, parts["agent"].address) == ("<node_name>", "<node_ip>")
    api_port = parts["api"].listen.split(":")[1]
    ports = documents[("Service", "astraeus-api")]["spec"]["ports"]
    assert [port["port"] for port in ports] == [int(api_port)]
    assert container(api)["readinessProbe"]["httpGet"]["path"] == "/healthz"
    settings = documents[("ConfigMap", "astraeus-settings")]["data"]["settings.yaml"]
    for name, document in (("scheduler", scheduler), ("control", control), ("api", api), ("agent", agents)):
        mounts = {mount["mountPath"] for mount in container(document)["volumeMounts"]}
        assert str(Path(parts[name].settings).parent) in mounts
    (tmp_path / "settings.yaml").write_text(settings)
    assert load_settings(str(tmp_path / "settings.yaml")) == load_settings(None)


# ---- systemd ---------------------------------------------------------------------------------------------------


def unit(name: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in (DEPLOY / name).read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            values.setdefault(key, []).append(value)
    return values


UNITS = ["astraeus-control.service", "astraeus-scheduler.service", "astraeus-api.service", "astraeus-agent.service"]


def test_every_unit_in_deploy_is_tested() -> None:
    assert sorted(path.name for path in DEPLOY.glob("*.service")) == sorted(UNITS)


@pytest.mark.parametrize("name", UNITS)
def test_each_systemd_unit_runs_a_command_the_cli_takes(name: str) -> None:
    values = unit(name)
    (start,) = values["ExecStart"]
    program, *argv = shlex.split(start.replace("%H", "gpu-1.internal"))
    assert program.endswith("/bin/astraeus")
    args = parses(argv, name)
    read_variables([item.split("=", 1)[0] for item in values.get("Environment", [])], name)
    if args.command == "agent":
        assert args.address == "gpu-1.internal" and args.name == "gpu-1.internal"
    if args.settings:
        assert args.settings == "/etc/astraeus/settings.yaml"
    assert load_settings(str(DEPLOY / "settings.example.yaml"))
