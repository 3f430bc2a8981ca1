"""A cluster connected through a `temporal` CLI profile: every process (`control`, `scheduler`, `agent`) and verb
takes `--profile`, and runs in the profile's namespace, over mutual TLS with the profile's certificates (a proxy
ends TLS in front of the dev server, which serves none itself)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from temporalio.service import RPCError, RPCStatusCode

from tests.integration.harness import ASTRAEUS, Cluster
from tests.tls import SERVER_NAME, Certs, TlsProxy, make_certs
from workers.connect import Target, connect
from workers.devserver import DevServer, free_port
from workers.exits import ExitCode

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parent.parent.parent
NAMESPACE = "research"


def profiles(proxy: str, certs: Certs) -> str:
    tls = f'server_name = "{SERVER_NAME}"\nserver_ca_cert_path = "{certs.ca}"\n'
    mutual = f'client_cert_path = "{certs.client_cert}"\nclient_key_path = "{certs.client_key}"\n'
    return (
        f'[profile.ci]\naddress = "{proxy}"\nnamespace = "{NAMESPACE}"\n[profile.ci.tls]\n{tls}{mutual}'
        f'[profile.nocert]\naddress = "{proxy}"\nnamespace = "{NAMESPACE}"\n[profile.nocert.tls]\n{tls}'
    )


class ProfileCluster(Cluster):
    """The harness's cluster, each process and verb given `--profile ci` instead of `--temporal`."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.server = DevServer(root / "temporal", port=free_port(), ui_port=None, namespaces=(NAMESPACE,))
        self.certs = make_certs(root / "certs")
        self.proxy = TlsProxy(self.certs, self.server.address)
        self.config = root / "temporal.toml"
        self.config.write_text(profiles(self.proxy.address, self.certs))

    def env(self, profile: str = "ci") -> dict[str, str]:
        return {**os.environ, "ASTRAEUS_SCHEDULER": self.scheduler, "TEMPORAL_CONFIG_FILE": str(self.config),
                "TEMPORAL_PROFILE": profile}  # fmt: skip

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = (self.root / f"{name}.log").open("ab")
        cmd = [ASTRAEUS, *args, "--profile", "ci", "--settings", str(self.settings)]
        self.processes[name] = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env() | (env or {})
        )

    def cli(self, *args: str, check: bool = True, profile: str = "ci") -> subprocess.CompletedProcess[str]:
        result = subprocess.run([ASTRAEUS, *args], capture_output=True, text=True, timeout=60, env=self.env(profile))
        if check and result.returncode != 0:
            raise AssertionError(f"astraeus {' '.join(args)} exited {result.returncode}: {result.stderr}")
        return result

    def json(self, *args: str) -> Any:
        """Through the profile too (its namespace, its TLS), as a CLI process: not the harness's in-process call."""
        return json.loads(self.cli(*args, "--json").stdout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProfileCluster]:
    c = ProfileCluster(tmp_path_factory.mktemp("profiles"))
    with c.proxy:
        try:
            c.start({"p0": ["--gpus", "1xL4-24GB"]})
            yield c
        finally:
            c.stop()


async def test_a_run_goes_through_the_profiles_tls_into_its_namespace(cluster: ProfileCluster) -> None:
    result = cluster.cli("submit", str(ROOT / "examples" / "hello.yaml"), "--wait", "--timeout", "60")
    assert result.stdout.startswith("Completed")
    assert cluster.proxy.served > 0  # every process connected through the TLS proxy
    research = await connect(Target(address=cluster.server.address, namespace=NAMESPACE))
    assert (await research.get_workflow_handle("job/default/hello").describe()).id == "job/default/hello"
    default = await connect(cluster.server.address)
    with pytest.raises(RPCError) as error:
        await default.get_workflow_handle("job/default/hello").describe()
    assert error.value.status == RPCStatusCode.NOT_FOUND


async def test_tls_without_the_client_certificate_is_refused(cluster: ProfileCluster) -> None:
    result = await asyncio.to_thread(cluster.cli, "ls", check=False, profile="nocert")
    assert result.returncode == ExitCode.UNREACHABLE
    assert result.stderr.startswith(
        f"astraeus: cannot reach Temporal at {cluster.proxy.address} (namespace {NAMESPACE}): "
    )
