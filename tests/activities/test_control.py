"""The control plane's load_settings: the settings, and a new run's first placement asked of the scheduler."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import cast

from temporalio.client import Client

from activities.control import ControlActivities
from workflows.domain.run.events import PlacementUpdate
from workflows.domain.run.job import first_requests
from workflows.domain.settings import Settings
from workflows.domain.spec import parse_spec
from workflows.messages import PROTOCOL, LoadSettingsInput, PlaceInput, PlaceResult

SETTINGS = Settings(stale_grace_seconds=20)
AT = datetime(2026, 12, 2, 5, 0, tzinfo=UTC)
SPEC = parse_spec({"name": "first", "groups": [{"name": "w", "replicas": 2, "command": ["x"], "gpus": 1}]})


class Scheduler:
    def __init__(self, down: bool = False) -> None:
        self.down = down
        self.asked: list[PlaceInput] = []

    async def place(self, input: PlaceInput) -> PlaceResult:
        self.asked.append(input)
        if self.down:
            raise ConnectionRefusedError("the scheduler at 127.0.0.1:7244 did not answer /place")
        node = {"w-0": "m0", "w-1": None}
        return PlaceResult(
            answers=[
                PlacementUpdate(task_id=r.task_id, attempt=r.attempt, node=node[r.task_id]) for r in input.requests
            ]
        )


def control(tmp_path: Path, scheduler: Scheduler | None) -> ControlActivities:
    return ControlActivities(SETTINGS, cast(Client, None), tmp_path / "ca", scheduler=scheduler)


async def test_a_new_run_gets_its_settings_and_its_first_workers_placed(tmp_path: Path) -> None:
    scheduler = Scheduler()
    loaded = await control(tmp_path, scheduler).load_settings(LoadSettingsInput(spec=SPEC, at=AT))
    asked = first_requests(SPEC, SETTINGS, PROTOCOL, AT)
    assert [r.task_id for r in asked] == ["w-0", "w-1"]
    assert scheduler.asked == [PlaceInput(requests=asked)]
    assert (loaded.settings, loaded.protocol, loaded.requests) == (SETTINGS, PROTOCOL, asked)
    assert [(a.task_id, a.node) for a in loaded.answers] == [("w-0", "m0"), ("w-1", None)]
    assert loaded.at == AT  # the run's first decision is taken then, in a replay too


async def test_without_a_run_or_a_scheduler_that_answers_only_the_settings_are_loaded(tmp_path: Path) -> None:
    down = Scheduler(down=True)
    for loaded, at in (
        (await control(tmp_path, Scheduler()).load_settings(), None),  # a workflow that is no run (subnets)
        (await control(tmp_path, down).load_settings(LoadSettingsInput(spec=SPEC, at=AT)), AT),  # it places itself
        (await control(tmp_path, None).load_settings(LoadSettingsInput(spec=SPEC, at=AT)), AT),
    ):
        assert (loaded.settings, loaded.protocol, loaded.requests, loaded.answers) == (SETTINGS, PROTOCOL, [], [])
        assert loaded.at == at
    assert len(down.asked) == 1
