"""`make screenshots`: PNGs of the console's main pages in docs/, taken in Debian's headless chromium (through
Selenium, since the page needs a login that a bare `chromium --screenshot` cannot type) against a small real
cluster: the runs list, a waiting run, a failing run, the machines, a machine's page and the quotas."""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.integration.harness import Cluster
from tests.integration.test_console import Console, browser

DOCS = Path(__file__).resolve().parents[2] / "docs"


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="astraeus-screenshots-"))
    cluster = Cluster(root, backoff_base_seconds=30, backoff_cap_seconds=30)
    try:
        cluster.start({"a0": ["--gpus", "2xL4-24GB", "--cpus", "4", "--memory-bytes", "16GiB"],
                       "a1": ["--gpus", "4xL4-24GB", "--cpus", "8", "--memory-bytes", "32GiB"]})  # fmt: skip
        url = cluster.spawn_api()
        with browser(root / "chromium") as driver:
            console = Console(cluster, url, driver)
            auth = {"authorization": f"Bearer {console.admin}"}
            httpx.put(f"{url}/quotas/research", json={"gpus": 4}, headers=auth, timeout=60).raise_for_status()
            console.submit(
                {"name": "train", "groups": [{"name": "w", "replicas": 2, "gpus": 1, "command": ["sleep", "600"]}]}
            )
            big = {"name": "big", "groups": [{"name": "w", "gpus": 8, "command": ["sleep", "60"]}]}
            console.submit(big, token=console.other)  # a workspace without a quota: no machine fits it
            console.submit(
                {"name": "flaky", "groups": [{"name": "w", "command": ["sh", "-c", "echo out of data; exit 3"]}]}
            )
            cluster.wait_state("research/train", "Running")
            data = root / "a1-data"  # a1 keeps copies of drives there: its page shows it, and the admin's form
            data.mkdir()
            httpx.put(
                f"{url}/nodes/a1/data-location", json={"path": str(data)}, headers=auth, timeout=60
            ).raise_for_status()
            console.login(console.admin)
            _row = 'tr[data-run="research/train"]'
            console.text(_row, contains="2 / 2")
            pages = {"runs": "#/runs", "waiting-run": "#/runs/other/big", "failing-run": "#/runs/research/flaky",
                     "machines": "#/machines", "machine": "#/machines/a1", "quotas": "#/quotas"}  # fmt: skip
            DOCS.mkdir(exist_ok=True)
            for name, hash_ in pages.items():
                driver.get(f"{url}/console/{hash_}")
                time.sleep(2.5)  # a poll or two: the page drawn from the API's answers
                if name == "machine":  # its data location, its copies and the admin's form
                    driver.execute_script("document.getElementById('data-title').scrollIntoView()")
                driver.save_screenshot(str(DOCS / f"console-{name}.png"))
                print(f"docs/console-{name}.png")  # noqa: T201
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
