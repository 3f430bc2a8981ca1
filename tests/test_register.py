"""An agent's registration: a refusal ends it; an update the machine's workflow never processed is tried again."""

from __future__ import annotations

from typing import Any, cast

import pytest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError

from activities.agent.lease import RegistrationRefused, register
from workers import services
from workflows.domain.inventory import NodeInventory, NodeState, NodeView
from workflows.domain.settings import Settings

NODE = NodeInventory(name="m-0", cpus=1, memory_bytes=2**30)


class Machine:
    """The machine's workflow as `register` reaches it: each update answers the next of `outcomes`."""

    def __init__(self, *outcomes: BaseException | NodeView) -> None:
        self.outcomes = list(outcomes)
        self.updates = 0

    async def start_workflow(self, *args: Any, **kwargs: Any) -> Machine:
        return self

    async def execute_update(self, update: Any, request: Any) -> NodeView:
        self.updates += 1
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def unprocessed() -> WorkflowUpdateFailedError:
    return WorkflowUpdateFailedError(
        ApplicationError("Workflow Update is rejected because it wasn't processed by worker", type="UnprocessedUpdate")
    )


async def test_a_registration_the_workflow_did_not_process_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(services.asyncio, "sleep", _no_wait)
    view = NodeView(name="m-0", state=NodeState.READY)
    machine = Machine(unprocessed(), unprocessed(), view)
    assert await register(cast(Client, machine), NODE, Settings(), "host:1:aa") == view
    assert machine.updates == 3


async def test_a_refused_registration_is_not_tried_again() -> None:
    refused = WorkflowUpdateFailedError(ApplicationError("inventory of m-1 sent to machine m-0"))
    machine = Machine(refused, NodeView(name="m-0", state=NodeState.READY))
    with pytest.raises(RegistrationRefused) as error:
        await register(cast(Client, machine), NODE, Settings(), "host:1:aa")
    assert str(error.value) == "machine m-0 could not register: inventory of m-1 sent to machine m-0"
    assert machine.updates == 1


async def _no_wait(seconds: float) -> None:
    return None
