"""Which "machine is not ready" a machine says: its state once its agent registered, "(no capacity reported)"
while it never did (its workflow starts Down, with no inventory)."""

from __future__ import annotations

import pytest

from tests.domain.builders import machine, unreported
from workflows.domain.inventory import NodeState, NodeView
from workflows.domain.scheduling.machines import compile_node


@pytest.mark.parametrize(
    ("view", "reason"),
    [
        pytest.param(NodeView(name="n0", state=NodeState.DOWN), "machine is not ready (no capacity reported)",
                     id="a machine whose agent never registered reports no capacity"),
        pytest.param(unreported("n0"), "machine is not ready (no capacity reported)",
                     id="a ready machine without an inventory reports no capacity"),
        pytest.param(machine("n0", state=NodeState.DOWN), "machine is not ready (Down)",
                     id="a registered machine that went down says so"),
    ],
)  # fmt: skip
def test_a_machine_not_ready_says_why(view: NodeView, reason: str) -> None:
    not_ready = compile_node(view).not_ready
    assert not_ready is not None and not_ready.text == reason
