"""`identity: true` end to end on a real cluster (dev server, control plane with its CA directory, scheduler and an
agent as processes): a worker waits "Waiting for the worker's identity: <why>" while the cluster CA cannot issue,
then gets a certificate naming its workspace, run, worker and attempt, signed by the CA `astraeus ca show` prints,
as files its variables name; the certificate is renewed while it runs; and the CA's key is in no history."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

from tests.integration.harness import ASTRAEUS, Cluster

pytestmark = pytest.mark.integration

GIB = 2**30
NODE = "i0"
READ = (  # the worker prints the identity its certificate names, from the files its variables name
    "import os, time; from cryptography import x509; "
    "c = x509.load_pem_x509_certificate(open(os.environ['ASTRAEUS_IDENTITY_CERT'], 'rb').read()); "
    "k = open(os.environ['ASTRAEUS_IDENTITY_KEY'], 'rb').read(); "
    "print(c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value"
    ".get_values_for_type(x509.UniformResourceIdentifier)[0], 'key' if b'PRIVATE KEY' in k else 'no key', flush=True); "
    "time.sleep(600)"
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("identity")
    (root / "blocked").write_text("a file where the CA's directory should be: the CA cannot be made yet\n")
    c = Cluster(root, identity_ttl_seconds=10)  # renewed at half its life: every 5 s
    try:
        c.server.start()
        c.spawn("control", "control", "--ca-dir", str(root / "blocked" / "ca"))
        c.spawn("scheduler", "scheduler")
        c.spawn_agent(NODE, "--cpus", "4", "--memory-bytes", str(8 * GIB))
        c.wait_for(lambda: len(c.json("nodes")) == 1, what="the agent registered")
        yield c
    finally:
        c.stop()


def histories(cluster: Cluster, query: str) -> list[str]:
    """The JSON of every workflow's history that `query` lists."""

    async def read() -> list[str]:
        client = await Client.connect(cluster.address, data_converter=pydantic_data_converter)
        found = []
        async for run in client.list_workflows(query):
            history = await client.get_workflow_handle(run.id, run_id=run.run_id).fetch_history()
            found.append(history.to_json())
        return found

    return asyncio.run(read())


def payloads(history_json: str) -> bytes:
    """Every payload of a history, decoded, and the history itself: what a search must look through."""
    data = [base64.b64decode(m) for m in re.findall(r'"data":\s*"([A-Za-z0-9+/=]+)"', history_json)]
    return b"\n".join([history_json.encode(), *data])


def test_a_worker_waits_for_its_identity_then_holds_a_certificate_the_cluster_ca_signed_and_renews(
    cluster: Cluster, tmp_path: Path
) -> None:
    spec = {"name": "ident", "groups": [{"name": "w", "command": [sys.executable, "-c", READ], "cpu": 0.5,
                                         "identity": True}]}  # fmt: skip
    (tmp_path / "ident.yaml").write_text(yaml.safe_dump(spec))
    cluster.cli("submit", str(tmp_path / "ident.yaml"))

    waiting = cluster.wait_for(
        lambda: (d := cluster.describe("ident"))["tasks"] and d["tasks"][0]["status"]["state"] == "Preparing" and d,
        "the worker to wait for its identity",
    )
    blocked = cluster.root / "blocked" / "ca"
    assert waiting["tasks"][0]["status"]["reason"] == (
        "Waiting for the worker's identity: the cluster CA did not issue it: the cluster CA cannot sign: "
        f"[Errno 20] Not a directory: '{blocked}'"
    )
    (cluster.root / "blocked").unlink()  # the CA can be made now: the next ask is issued

    running = cluster.wait_state("ident", "Running", timeout=90)
    worker = running["tasks"][0]
    reasons = [e["reason"] for e in worker["history"]]
    assert reasons.index(waiting["tasks"][0]["status"]["reason"]) < reasons.index("Container started")
    identity = f"spiffe://astraeus/ns/default/run/ident/worker/w-0/attempt/{worker['attempt']}"
    cluster.wait_for(lambda: f"{identity} key\n" in cluster.cli("logs", "ident/w-0").stdout, "the worker's output")

    shown = subprocess.run([ASTRAEUS, "ca", "show", "--ca-dir", str(blocked)], capture_output=True, check=True)
    ca_pem = shown.stdout
    ca = x509.load_pem_x509_certificate(ca_pem)
    files = cluster.agent_dir(NODE) / "identity" / f"default.ident.w-0.{worker['attempt']}"
    first = x509.load_pem_x509_certificate((files / "cert.pem").read_bytes())
    first.verify_directly_issued_by(ca)
    assert (files / "bundle.pem").read_bytes() == ca_pem

    renewed = cluster.wait_for(
        lambda: (
            (c := x509.load_pem_x509_certificate((files / "cert.pem").read_bytes())).serial_number
            != first.serial_number
            and c
        ),
        "its certificate to be renewed",
        timeout=30,
    )
    renewed.verify_directly_issued_by(ca)
    assert renewed.not_valid_after_utc > first.not_valid_after_utc

    # The CA's key: in no history of the run, nor of the workflows that issued its certificates (which hold them).
    key = serialization.load_pem_private_key((blocked / "ca.key").read_bytes(), password=None)
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    pem_body = "".join((blocked / "ca.key").read_text().splitlines()[1:-1]).encode()
    run = histories(cluster, 'WorkflowId = "job/default/ident"')
    issued = histories(cluster, 'WorkflowType = "IdentityWorkflow"')
    assert len(run) == 1 and len(issued) >= 2
    searched = b"\n".join(payloads(h) for h in [*run, *issued])
    cert_body = "".join((files / "cert.pem").read_text().splitlines()[1:-1]).encode()
    assert json.dumps(cert_body.decode())[1:40].encode() in searched  # what is issued is there: the search sees
    for secret in (der, pem_body, pem_body[:64], base64.b64encode(der)):
        assert secret not in searched

    cluster.cli("cancel", "ident")
    cluster.wait_state("ident", "Cancelled")
