"""`make demo` on a busy machine: a port taken between its choice and the Temporal server's bind costs a new choice,
not the demo."""

from __future__ import annotations

from pathlib import Path

import pytest

from workers import demo
from workers.devserver import DevServerError
from workers.embedded import Embedded

TAKEN = DevServerError('the Temporal dev server exited with code 1: {"message":"listen tcp 127.0.0.1:38087: bind: '
                       'address already in use"}')  # fmt: skip


def starts(monkeypatch: pytest.MonkeyPatch, outcomes: list[Exception | None]) -> list[Embedded]:
    tried: list[Embedded] = []

    async def enter(self: Embedded) -> Embedded:
        tried.append(self)
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return self

    monkeypatch.setattr(Embedded, "__aenter__", enter)
    return tried


async def test_a_port_taken_at_bind_is_chosen_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    tried = starts(monkeypatch, [TAKEN, TAKEN, None])
    embedded = await demo.started(tmp_path)
    assert embedded is tried[-1] and len(tried) == 3
    assert len({(e.server.port, e.server.ui_port) for e in tried}) == 3  # new ports each time


async def test_it_gives_up_after_its_tries_and_on_any_other_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    starts(monkeypatch, [TAKEN] * demo.PORT_TRIES)
    with pytest.raises(DevServerError, match="address already in use"):
        await demo.started(tmp_path)
    other = DevServerError("the Temporal dev server did not listen on 7233 in 30 s")
    tried = starts(monkeypatch, [other, None])
    with pytest.raises(DevServerError, match="did not listen"):
        await demo.started(tmp_path)
    assert len(tried) == 1
