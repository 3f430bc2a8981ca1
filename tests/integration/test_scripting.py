"""Astraeus in scripts and CI, through the `astraeus` CLI against a real cluster: exit codes by outcome, `wait`,
`submit --wait/--follow`, `logs --follow`, `ls` from one visibility query with its pages, `nodes` with cordons and
memory in binary units, times in the viewer's zone, a closed pipe."""

from __future__ import annotations

import os
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import ASTRAEUS, Cluster

pytestmark = pytest.mark.integration

GIB = 2**30


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start({"s0": ["--gpus", "2xL4-24GB", "--cpus", "4", "--memory-bytes", "16GiB"]})
        yield c
    finally:
        c.stop()


def astraeus(cluster: Cluster, *args: str, tz: str | None = None) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, `--temporal` before the verb; `tz` is the viewer's zone (TZ)."""
    env = {**os.environ, **({"TZ": tz} if tz else {})}
    return subprocess.run(
        [ASTRAEUS, "--temporal", cluster.address, *args], capture_output=True, text=True, timeout=90, env=env
    )


def spec(tmp_path: Path, name: str, command: str, **group: object) -> str:
    path = tmp_path / f"{name}.yaml"
    extra = "".join(f", {k}: {v}" for k, v in group.items())
    path.write_text(textwrap.dedent(f"name: {name}\ngroups: [{{name: w, command: [sh, -c, '{command}']{extra}}}]\n"))
    return str(path)


def test_a_completed_run_exits_0_everywhere_and_submit_prints_the_id_the_verbs_take(cluster: Cluster) -> None:
    submitted = astraeus(cluster, "submit", "examples/hello.yaml")
    assert (submitted.returncode, submitted.stdout) == (0, "submitted default/hello\n")
    waited = astraeus(cluster, "wait", "default/hello", "--timeout", "60")
    assert (waited.returncode, waited.stdout) == (0, "Completed: All workers completed\n"), waited.stderr
    for run in ("hello", "default/hello", "job/default/hello"):
        assert astraeus(cluster, "status", run).returncode == 0
    followed = astraeus(cluster, "events", "hello", "--follow")
    assert followed.returncode == 0
    assert "run          Completed    All workers completed" in followed.stdout


def test_a_failed_run_exits_1_from_submit_wait_status_and_events_follow(cluster: Cluster) -> None:
    waited = astraeus(cluster, "submit", "examples/fail.yaml", "--wait")
    assert waited.returncode == 1, waited.stderr
    assert waited.stderr == "submitted default/fail\n"
    assert waited.stdout.startswith("Failed: Worker fail-0 failed on s0: Exited with code 3")
    assert astraeus(cluster, "status", "fail").returncode == 1
    assert astraeus(cluster, "events", "fail", "--follow").returncode == 1
    assert astraeus(cluster, "wait", "fail", "--json").returncode == 1


def test_submit_follow_prints_every_event_and_exits_by_the_end(cluster: Cluster, tmp_path: Path) -> None:
    result = astraeus(cluster, "submit", spec(tmp_path, "quick", "exit 0"), "--follow")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "submitted default/quick"
    assert "Run created" in lines[1]
    assert "run          Completed    All workers completed" in result.stdout


def test_waiting_past_the_timeout_exits_7_and_a_cancelled_run_exits_5(cluster: Cluster, tmp_path: Path) -> None:
    astraeus(cluster, "submit", spec(tmp_path, "huge", "true", gpus=64))
    late = astraeus(cluster, "wait", "huge", "--for", "Running", "--timeout", "1")
    assert late.returncode == 7
    assert late.stderr.startswith("astraeus: default/huge is Pending after 1 s: ")
    assert astraeus(cluster, "cancel", "huge").returncode == 0
    cancelled = astraeus(cluster, "wait", "huge", "--timeout", "60")
    assert (cancelled.returncode, cancelled.stdout.split(":")[0]) == (5, "Cancelled")
    assert astraeus(cluster, "status", "huge").returncode == 5


def test_wait_for_a_state_returns_once_the_run_reached_it(cluster: Cluster, tmp_path: Path) -> None:
    astraeus(cluster, "submit", spec(tmp_path, "nap", "sleep 60"))
    running = astraeus(cluster, "wait", "nap", "--for", "Running", "--timeout", "60")
    assert (running.returncode, running.stdout.split(":")[0]) == (0, "Running"), running.stderr
    astraeus(cluster, "cancel", "nap")
    assert astraeus(cluster, "wait", "nap", "--timeout", "60").returncode == 5


@pytest.mark.parametrize(
    "args",
    [["status", "nope"], ["wait", "nope"], ["events", "nope", "--follow"], ["logs", "hello/w-9"],
     ["nodes", "cordon", "nope"], ["quota", "rm", "nope"]],
    ids=["status", "wait", "events --follow", "logs of an unknown worker", "an unknown machine", "an unknown quota"],
)  # fmt: skip
def test_what_does_not_exist_exits_3(cluster: Cluster, args: list[str]) -> None:
    if args[0] == "logs":
        astraeus(cluster, "wait", "hello", "--timeout", "60")  # hello exists (the first test submits it)
    result = astraeus(cluster, *args)
    assert result.returncode == 3, result.stderr


def test_logs_follow_prints_each_line_as_it_comes_until_the_worker_ends(cluster: Cluster, tmp_path: Path) -> None:
    astraeus(cluster, "submit", spec(tmp_path, "ticker", "for i in 1 2 3 4; do echo line $i; sleep 1; done"))
    followed = astraeus(cluster, "logs", "ticker/w-0", "--follow")
    assert (followed.returncode, followed.stdout) == (0, "line 1\nline 2\nline 3\nline 4\n"), followed.stderr


def test_ls_lists_runs_from_one_query_with_age_workers_gpus_and_pages(cluster: Cluster, tmp_path: Path) -> None:
    for name in ("page-a", "page-b", "page-c"):
        astraeus(cluster, "submit", spec(tmp_path, name, "true", replicas=2))
    for name in ("page-a", "page-b", "page-c"):
        astraeus(cluster, "wait", name, "--timeout", "60")
    human = astraeus(cluster, "ls", "--state", "Completed", "--limit", "100").stdout.splitlines()
    assert human[0].split() == ["NAMESPACE", "NAME", "STATE", "AGE", "WORKERS", "GPUS"]
    row = next(line.split() for line in human if " page-a " in line)
    assert row[:3] == ["default", "page-a", "Completed"] and row[4:] == ["2", "0"]
    assert row[3].endswith("s") or row[3].endswith("m")

    seen: list[str] = []
    page = None
    while True:
        listed = cluster.json("ls", "--limit", "2", *(["--page", page] if page else []))
        assert len(listed["runs"]) <= 2
        seen += [r["name"] for r in listed["runs"]]
        page = listed["next_page"]
        if page is None:
            break
    assert {"page-a", "page-b", "page-c", "hello"} <= set(seen)
    assert len(seen) == len(set(seen))
    more = astraeus(cluster, "ls", "--limit", "1")
    assert more.stderr.startswith("more runs: astraeus ls --page ")
    bad = astraeus(cluster, "ls", "--page", "bm90IGEgdG9rZW4=")
    assert (bad.returncode, bad.stderr.strip()) == (
        2,
        "astraeus: --page bm90IGEgdG9rZW4=: not a page token that ls printed",
    )


def test_nodes_show_a_cordon_and_memory_in_binary_units(cluster: Cluster) -> None:
    assert astraeus(cluster, "nodes", "cordon", "s0", "--reason", "fan replacement").returncode == 0
    try:
        human = astraeus(cluster, "nodes").stdout.splitlines()
        assert human[0].split() == ["MACHINE", "STATE", "CPUS", "MEMORY", "GPUS", "CONDITIONS"]
        assert human[1].split() == ["s0", "Ready,Cordoned", "4", "16", "GiB", "2", "L4", "cordoned:", "fan",
                                    "replacement"]  # fmt: skip
    finally:
        astraeus(cluster, "nodes", "uncordon", "s0")
    assert astraeus(cluster, "nodes").stdout.splitlines()[1].split()[1] == "Ready"


def test_times_are_shown_in_the_viewers_zone_with_the_zone_or_in_utc(cluster: Cluster) -> None:
    astraeus(cluster, "wait", "hello", "--timeout", "60")
    tokyo = astraeus(cluster, "history", "hello", tz="Asia/Tokyo").stdout.splitlines()
    utc = astraeus(cluster, "history", "hello", "--utc", tz="Asia/Tokyo").stdout.splitlines()
    assert tokyo[1].split()[1] == "JST" and utc[1].split()[1] == "UTC"
    hours = int(tokyo[1].split()[0][:2]), int(utc[1].split()[0][:2])
    assert (hours[0] - hours[1]) % 24 == 9
    assert " JST" in astraeus(cluster, "describe", "hello", tz="Asia/Tokyo").stdout


def test_history_into_a_closed_pipe_ends_quietly(cluster: Cluster) -> None:
    astraeus(cluster, "wait", "hello", "--timeout", "60")
    read, write = os.pipe()
    os.close(read)  # as `| head -1` once it has its line
    try:
        process = subprocess.run(
            [ASTRAEUS, "history", "hello", "--temporal", cluster.address],
            stdout=write, stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)
    assert (process.returncode, process.stderr) == (141, "")
