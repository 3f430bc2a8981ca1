"""The HTTP API (`astraeus api`) against a real cluster, through httpx as any client calls it: a run submitted,
described, its logs read, a worker stopped, the run cancelled, its events followed as Server-Sent Events until it
ends; workspace tokens that see only their own workspace (404 for every other run, 401 without a token); the
admin's verbs; and the OpenAPI document it serves. Deleting a run is tests/integration/test_delete.py; the README's
curl walk-through runs as written, with the default ports, in tests/integration/test_one_cluster.py."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import BIN, Cluster, end_group
from workers.api import openapi_document
from workers.devserver import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).parent.parent.parent
SLEEPER = (
    "name: {name}\ngroups: [{{name: w, replicas: 2, command: [sh, -c, 'echo hello from $ASTRAEUS_TASK; sleep 60']}}]\n"
)


class Api:
    """The API process of the cluster, and a token of each kind."""

    def __init__(self, cluster: Cluster, url: str) -> None:
        self.cluster = cluster
        self.url = url
        self.admin = self.token("--admin")
        self.research = self.token("research")
        self.other = self.token("other")

    def token(self, *args: str) -> str:
        return self.cluster.cli("token", "create", *args).stdout.strip()

    def client(self, token: str | None) -> httpx.Client:
        headers = {"authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start({"a0": ["--gpus", "2xL4-24GB", "--cpus", "4", "--memory-bytes", "16GiB"]})
        url = c.spawn_api()
        yield Api(c, url)
    finally:
        c.stop()


def _running(api: Api, token: str, run: str) -> dict[str, Any]:
    with api.client(token) as http:
        return api.cluster.wait_for(  # type: ignore[no-any-return]
            lambda: (d := http.get(f"/jobs/{run}").json())["status"]["state"] == "Running" and d, f"{run} to run"
        )


def _read_events(api: Api, token: str, run: str, into: list[tuple[str, dict[str, Any]]]) -> None:
    """Read the run's event stream until the server ends it: (event type, data) of each."""
    with api.client(token) as http, http.stream("GET", f"/jobs/{run}/events") as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        kind, data = "message", ""
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
            elif not line and data:
                into.append((kind, json.loads(data)))
                kind, data = "message", ""


def test_a_run_submitted_described_logged_stopped_and_cancelled_with_its_events_followed(api: Api) -> None:
    with api.client(api.research) as http:
        submitted = http.post(
            "/jobs", content=SLEEPER.format(name="walk"), headers={"content-type": "application/yaml"}
        )
        assert submitted.status_code == 201, submitted.text
        assert submitted.json() == {"run": "research/walk", "id": "job/research/walk", "namespace": "research",
                                    "name": "walk"}  # fmt: skip
        described = _running(api, api.research, "research/walk")
        assert set(described) == set(api.cluster.describe("research/walk"))  # the shape of describe --json
        assert [t["id"] for t in described["tasks"]] == ["w-0", "w-1"]
        events: list[tuple[str, dict[str, Any]]] = []
        reader = threading.Thread(target=_read_events, args=(api, api.research, "research/walk", events))
        reader.start()

        task = http.get("/jobs/research/walk/tasks/w-0").json()
        assert (task["id"], task["node"], task["status"]["state"]) == ("w-0", "a0", "Running")
        logs = api.cluster.wait_for(lambda: http.get("/jobs/research/walk/tasks/w-0/logs?tail=5").text, "output")
        assert logs == "hello from w-0\n"

        stopped = http.post("/jobs/research/walk/tasks/w-0/stop", json={"reason": "Making room"})
        assert stopped.status_code == 200, stopped.text
        history = api.cluster.wait_for(
            lambda: (
                (h := http.get("/jobs/research/walk/history").json())["tasks"]["w-0"][-1]["state"] == "Cancelled" and h
            ),
            "w-0 to be stopped",
        )
        assert ("Stopping", "Making room") in [(e["state"], e["reason"]) for e in history["tasks"]["w-0"]]
        # The spec's form, with the task named in full; a default reason.
        assert http.post("/tasks/research/walk/w-1/stop").status_code == 200
        api.cluster.wait_for(
            lambda: http.get("/jobs/research/walk/tasks/w-1").json()["status"]["state"] == "Cancelled", "w-1 stopped"
        )
        w1 = http.get("/jobs/research/walk/tasks/w-1").json()
        assert ("Stopping", "Stopped by scheduler") in [(e["state"], e["reason"]) for e in w1["history"]]
        ended = api.cluster.wait_for(
            lambda: (s := http.get("/jobs/research/walk").json()["status"])["state"] == "Cancelled" and s, "the end"
        )
        assert ended["reason"] == "All workers ended; some were cancelled"
        refused = http.post("/jobs/research/walk/cancel")
        assert (refused.status_code, refused.json()) == (409, {"error": "run research/walk already ended: Cancelled"})

    reader.join(timeout=30)
    assert not reader.is_alive(), "the event stream did not end with the run"
    assert events[-1] == ("end", {**ended, "finished_at": events[-1][1]["finished_at"]})
    changes = [data for kind, data in events if kind == "message"]
    assert set(changes[0]) == {"at", "object", "state", "reason", "code"}
    assert (changes[0]["object"], changes[0]["state"], changes[0]["reason"]) == ("run", "Pending", "Run created")
    assert ("run", "Cancelled", "All workers ended; some were cancelled") in [
        (e["object"], e["state"], e["reason"]) for e in changes
    ]


def test_cancel_and_a_resumed_event_stream(api: Api) -> None:
    with api.client(api.research) as http:
        assert (
            http.post(
                "/jobs", json={"name": "short", "groups": [{"name": "w", "command": ["sleep", "60"]}]}
            ).status_code
            == 201
        )
        _running(api, api.research, "research/short")
        cancelled = http.post("/jobs/research/short/cancel")
        assert cancelled.status_code == 200, cancelled.text
        events: list[tuple[str, dict[str, Any]]] = []
        _read_events(api, api.research, "research/short", events)
        assert events[-1][0] == "end" and events[-1][1]["state"] == "Cancelled"
        resumed: list[tuple[str, dict[str, Any]]] = []
        with http.stream("GET", "/jobs/research/short/events", headers={"last-event-id": "2"}) as response:
            text = response.read().decode()
        resumed = [(b.split("\n")[0]) for b in text.strip().split("\n\n")]
        assert resumed[0] == "id: 3" and len(resumed) == len(events) - 2


def test_a_bad_spec_is_refused_naming_the_field_and_a_taken_name_is_a_conflict(api: Api) -> None:
    with api.client(api.research) as http:
        bad = http.post("/jobs", json={"name": "bad", "groups": [{"name": "w", "command": ["x"], "gpus": -1}]})
        assert (bad.status_code, bad.json()) == (
            422,
            {"error": "invalid run spec:\ngroups.0.gpus: Input should be greater than or equal to 0"},
        )
        unknown = http.post("/jobs", content="name: u\nbogus: 1\ngroups: [{name: w, command: [x]}]\n",
                            headers={"content-type": "application/yaml"})  # fmt: skip
        assert (unknown.status_code, unknown.json()["error"]) == (422, "invalid run spec:\nbogus: unknown field")
        assert http.post("/jobs", content=b"{not json").status_code == 422
        spec = {"name": "twice", "groups": [{"name": "w", "command": ["true"]}]}
        assert http.post("/jobs", json=spec).status_code == 201
        again = http.post("/jobs", json=spec)
        assert (again.status_code, again.json()) == (
            409,
            {"error": "a run named twice already exists in namespace research"},
        )
        elsewhere = http.post("/jobs", json=spec | {"namespace": "other"})
        assert elsewhere.status_code == 404
        assert http.get("/jobs", params={"state": "Sleeping"}).status_code == 422


ROUTES = [
    ("GET", "/jobs/{run}", None),
    ("POST", "/jobs/{run}/cancel", None),
    ("DELETE", "/jobs/{run}", None),
    ("GET", "/jobs/{run}/history", None),
    ("GET", "/jobs/{run}/events", None),
    ("GET", "/jobs/{run}/tasks/w-0", None),
    ("POST", "/jobs/{run}/tasks/w-0/stop", {"reason": "no"}),
    ("POST", "/tasks/{run}/w-0/stop", None),
    ("GET", "/jobs/{run}/tasks/w-0/logs", None),
    ("GET", "/jobs/{run}/tasks/w-0/logs?follow=true", None),
]


def test_another_workspace_sees_nothing_of_a_run_and_no_token_gets_401(api: Api) -> None:
    with api.client(api.research) as http:
        assert http.post("/jobs", content=SLEEPER.format(name="private"),
                         headers={"content-type": "application/yaml"}).status_code == 201  # fmt: skip
    _running(api, api.research, "research/private")
    missing = {"error": "no run named private in namespace research"}
    for token, status in ((api.other, 404), (None, 401), ("astraeus_not-a-token", 401)):
        with api.client(token) as http:
            for method, path, body in ROUTES:
                answer = http.request(method, path.format(run="research/private"), json=body)
                assert answer.status_code == status, (token, method, path, answer.text)
                assert answer.json() == missing if status == 404 else answer.content == b"", (method, path)
            for method, path in (("GET", "/jobs"), ("POST", "/jobs"), ("GET", "/nodes"), ("GET", "/quotas")):
                if status == 401:
                    assert http.request(method, path).status_code == 401
    # It is the same answer as a run that does not exist; and the run is untouched.
    with api.client(api.research) as http:
        assert http.get("/jobs/research/nothing").json() == {"error": "no run named nothing in namespace research"}
        assert http.get("/jobs/research/private").json()["status"]["state"] == "Running"
    with api.client(api.other) as http:
        assert http.get("/jobs").json() == {"runs": [], "next_page": None}
        assert http.get("/jobs", params={"namespace": "research"}).json() == {"runs": [], "next_page": None}
    with api.client(api.research) as http:
        names = {r["name"] for r in http.get("/jobs").json()["runs"]}
        assert "private" in names and all(r["namespace"] == "research" for r in http.get("/jobs").json()["runs"])
        assert http.post("/jobs/research/private/cancel").status_code == 200


def test_machines_and_quotas_are_read_by_all_and_changed_by_admins_and_revoked_tokens_stop_working(api: Api) -> None:
    with api.client(api.research) as http:
        assert [n["name"] for n in http.get("/nodes").json()] == ["a0"]
        assert http.get("/nodes/a0").json()["name"] == "a0"
        assert http.get("/nodes/zz").status_code == 404
        refused = http.post("/nodes/a0/cordon", json={"reason": "mine"})
        assert (refused.status_code, refused.json()) == (403, {"error": "only an admin token may change machines"})
        assert http.put("/quotas/research", json={"gpus": 8}).status_code == 403
    with api.client(api.admin) as http:
        assert http.post("/nodes/a0/cordon", json={"reason": "fan"}).status_code == 200
        assert http.post("/nodes/a0/uncordon").status_code == 200
        assert http.put("/quotas/research", json={"gpus": 8}).json()[0]["gpus"] == 8
        assert {r["namespace"] for r in http.get("/jobs").json()["runs"]} >= {"research"}
        assert http.delete("/quotas/research").json() == []
    with api.client(api.other) as http:
        assert http.get("/quotas").json() == []
    secret = api.token("other", "--note", "short-lived")
    listed = api.cluster.json("token", "ls")
    (made,) = [t for t in listed if t["note"] == "short-lived"]
    assert set(made) == {"id", "namespace", "created_at", "note"}  # no digest shown, and no secret kept
    with api.client(secret) as http:
        api.cluster.wait_for(lambda: http.get("/jobs").status_code == 200, "the new token to be taken", 5)
        api.cluster.cli("token", "revoke", made["id"])
        api.cluster.wait_for(lambda: http.get("/jobs").status_code == 401, "the revoked token to be refused", 10)
    gone = api.cluster.cli("token", "revoke", made["id"], check=False)
    assert (gone.returncode, gone.stderr) == (3, f"astraeus: no token {made['id']}\n")


def test_drives_and_a_data_location_are_read_by_all_and_changed_by_admins(api: Api, tmp_path: Path) -> None:
    new = {"name": "weights", "machine": "a0", "size_bytes": 1024, "source": "/srv/weights"}
    with api.client(api.research) as http:
        refused = http.post("/drives", json=new)
        assert (refused.status_code, refused.json()) == (403, {"error": "only an admin token may change drives"})
        refused = http.put("/nodes/a0/data-location", json={"path": str(tmp_path)})
        assert (refused.status_code, refused.json()) == (403, {"error": "only an admin token may change machines"})
    with api.client(api.admin) as http:
        made = http.post("/drives", json=new)
        assert made.status_code == 200
        drive = {"name": "weights", "size_bytes": 1024, "node": "a0", "site": None, "problem": None}
        assert made.json() == [drive | {"source": "/srv/weights"}]
        taken = http.post("/drives", json=new)
        assert (taken.status_code, taken.json()) == (
            409,
            {"error": "drive weights exists: remove it first (astraeus drive rm weights)"},
        )
        bad = http.post("/drives", json={**new, "source": "s3://b/weights"})
        assert bad.status_code == 422 and "source s3://b/weights: expected" in json.dumps(bad.json())
        chosen = http.put("/nodes/a0/data-location", json={"path": str(tmp_path)})
        assert chosen.status_code == 200
        assert (chosen.json()["data_location"], chosen.json()["inventory"]["data_location"]) == (str(tmp_path),) * 2
        assert chosen.json()["inventory"]["data_free_bytes"] > 0
        missing = http.put("/nodes/a0/data-location", json={"path": "/no/such"})
        assert (missing.status_code, missing.json()) == (
            409,
            {"error": "data location /no/such: no such directory on machine a0"},
        )
        assert http.delete("/drives/weights").json() == []
        assert http.delete("/drives/weights").status_code == 404
    with api.client(api.other) as http:
        assert http.get("/drives").json() == []
        assert http.get("/nodes/a0").json()["inventory"]["data_location"] == str(tmp_path)


def test_a_workspace_issues_an_interactive_token_and_attaches_to_its_worker(api: Api) -> None:
    shell = "name: shell\ngroups: [{name: w, command: [sleep, '60'], capabilities: {interactive_token: true}}]\n"
    with api.client(api.research) as http:
        submitted = http.post("/jobs", content=shell, headers={"content-type": "application/yaml"})
        assert submitted.status_code == 201, submitted.text
        _running(api, api.research, "research/shell")
        issued = http.post("/jobs/research/shell/tasks/w-0/interactive-token", json={"ttl_seconds": 600})
        assert issued.status_code == 200, issued.text
        token = issued.json()["token"]
        ran = http.post(
            "/jobs/research/shell/tasks/w-0/attach",
            json={"token": token, "argv": ["sh"], "stdin": "echo hello from $ASTRAEUS_TASK\nexit 3\n"},
        )
        assert (ran.status_code, ran.json()) == (
            200,
            {"exit_code": 3, "stdout": "hello from w-0\n", "stderr": "", "cut": False},
        )
        forged = http.post("/jobs/research/shell/tasks/w-0/attach", json={"token": "astraeus-it-x", "argv": ["true"]})
        assert (forged.status_code, forged.json()) == (
            403,
            {"error": "token refused: not an interactive token (it is cut short or altered)"},
        )
        other = http.post("/jobs/research/shell/tasks/w-0/interactive-token").json()["token"]
        assert http.post("/jobs/research/shell/tasks/w-0/attach", json={"token": other, "argv": ["true"]}).json() == (
            {"exit_code": 0, "stdout": "", "stderr": "", "cut": False}
        )
        assert http.post("/jobs/research/shell/cancel").status_code == 200
    with api.client(api.other) as http:  # another workspace sees no such run
        hidden = http.post("/jobs/research/shell/tasks/w-0/interactive-token")
        assert (hidden.status_code, hidden.json()) == (404, {"error": "no run named shell in namespace research"})


def test_the_served_openapi_document_is_the_committed_one(api: Api) -> None:
    served = httpx.get(f"{api.url}/openapi.json").json()
    assert served == openapi_document() == json.loads((ROOT / "deploy" / "openapi.json").read_text())


def test_dev_serves_the_api_and_prints_an_admin_token_and_a_console_link_that_signs_in_once(tmp_path: Path) -> None:
    """`astraeus dev --api HOST:PORT`: the API and the console in the same process, an admin token for whoever
    started it, and the console's address with a code that trades for that token once."""
    listen = f"127.0.0.1:{free_port()}"
    args = ["--port", str(free_port()), "--ui-port", str(free_port()), "--api", listen, "--data-dir", str(tmp_path)]
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen([str(BIN / "astraeus"), "dev", *args], stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "local machine(s) ready" not in log.read_text():
            assert dev.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        lines = log.read_text().splitlines()
        line = next(t for t in lines if t.startswith("HTTP API: "))
        url, token = line.split("HTTP API: ", 1)[1].removesuffix(")").split(" (admin token: ")
        assert url == f"http://{listen}"
        assert httpx.get(f"{url}/nodes", headers={"authorization": f"Bearer {token}"}).json()[0]["name"] == "local-0"
        assert httpx.get(f"{url}/nodes").status_code == 401
        link = next(t for t in lines if t.startswith("Console: ")).removeprefix("Console: ")
        page, code = link.split("#sign-in=")
        assert page == f"{url}/console/" and httpx.get(page).status_code == 200
        assert httpx.post(f"{url}/console/sign-in", json={"code": code}).json() == {"token": token}
        assert httpx.post(f"{url}/console/sign-in", json={"code": code}).status_code == 401  # once only
    finally:
        end_group(dev)
    assert dev.returncode == 0, log.read_text()


def test_dev_names_a_taken_api_port_before_starting_anything_and_refuses_api_with_no_api(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        api = taken.getsockname()[1]
        port, ui = free_port(), free_port()
        refused = subprocess.run(
            [str(BIN / "astraeus"), "dev", "--port", str(port), "--ui-port", str(ui), "--api", f"127.0.0.1:{api}",
             "--data-dir", str(tmp_path / "refused")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert (refused.returncode, refused.stdout, refused.stderr) == (
        2,
        "",
        f"astraeus: dev: cannot start: port {api} (HTTP API and console) on 127.0.0.1 is in use, by another "
        "`astraeus dev`, `astraeus api` or Temporal server perhaps: stop it, or choose other ports with --port, "
        "--ui-port and --api (or --no-api)\n",
    )
    assert not (tmp_path / "refused").exists()
    both = subprocess.run([str(BIN / "astraeus"), "dev", "--api", "127.0.0.1:1", "--no-api"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert (both.returncode, both.stderr) == (2, "astraeus: dev: --api and --no-api: give one\n")
