"""The contract between the workflows and the processes that serve them (workflows/contracts.py): every activity a
workflow calls is registered, under its name and with the stub's types, by the process polling the queue it is sent
to; every signal, query and update declared is handled by its workflow with the declared types; and nothing is named
by a string literal. Each check is shown to fail when a name changes."""

from __future__ import annotations

import ast
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity, workflow

from activities.agent import AgentActivities
from activities.agent.drives import DriveActivities
from activities.control import ControlActivities
from activities.scheduler import SchedulerService
from activities.scheduler_lease import SchedulerLeaseHolder
from activities.scheduler_link import SchedulerLink
from workers.services import (
    Serves,
    control_serves,
    lease_serves,
    machine_serves,
    scheduler_lease_serves,
    scheduler_serves,
)
from workflows import contracts
from workflows.domain.settings import Settings
from workflows.messages import PlaceInput, PlaceResult

WORKFLOW_MODULES = [
    "job",
    "watches",
    "node",
    "quotas",
    "logs",
    "tokens",
    "deletion",
    "deleted_runs",
    "drives",
    "identity",
    "sessions",
]
WORKFLOW_MODULES += ["subnets", "scheduler_lease"]
SOURCE = Path(contracts.__file__).parent
MACHINE, INSTANCE = "m1", "host:42:cafe"

# Where each kind of task queue a workflow names is polled; local activities run in the worker of the workflow.
QUEUE_KINDS = {
    "CONTROL_TASK_QUEUE": "control",
    "SCHEDULER_TASK_QUEUE": "scheduler",
    "node_task_queue": "machine",
    "lease_task_queue": "lease",
    "scheduler_lease_task_queue": "scheduler_lease",
    "local": "control",
}


@dataclass(frozen=True)
class Call:
    """One activity a workflow module calls: the stub's name and the kind of queue it is sent to."""

    module: str
    line: int
    activity: str
    queue: str


def _unbuilt(cls: type[Any], **attributes: Any) -> Any:
    """An instance whose methods' definitions are all that is read (the process builds it with its ports)."""
    instance = cls.__new__(cls)
    for name, value in attributes.items():
        setattr(instance, name, value)
    return instance


def processes() -> dict[str, Serves]:
    """Each process's registrations, built by the functions its workers are built with (workers/services.py)."""
    agent = _unbuilt(AgentActivities, node_name=MACHINE, instance=INSTANCE, drives=_unbuilt(DriveActivities))
    return {
        "control": control_serves(ControlActivities(Settings(), _unbuilt(object)), _unbuilt(SchedulerLink)),
        "scheduler": scheduler_serves(_unbuilt(SchedulerService)),
        "machine": machine_serves(agent),
        "lease": lease_serves(agent),
        "scheduler_lease": scheduler_lease_serves(_unbuilt(SchedulerLeaseHolder, instance=INSTANCE)),
    }


# ---- what the workflows call (read from their source) ------------------------------------------------------------


def _queue_kind(node: ast.expr | None, dicts: dict[str, ast.Dict]) -> str:
    if isinstance(node, ast.Name) and node.id in QUEUE_KINDS:
        return QUEUE_KINDS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in QUEUE_KINDS:
        return QUEUE_KINDS[node.func.id]
    raise AssertionError(f"a task queue named by {ast.unparse(node) if node else 'nothing'}: use workflows.contracts")


def _options(call: ast.Call, dicts: dict[str, ast.Dict]) -> dict[str, ast.expr]:
    """The call's keywords, with `**options` looked up in a dict literal assigned in the same function."""
    found: dict[str, ast.expr] = {}
    for keyword in call.keywords:
        if keyword.arg is not None:
            found[keyword.arg] = keyword.value
        elif isinstance(keyword.value, ast.Name) and keyword.value.id in dicts:
            literal = dicts[keyword.value.id]
            found |= {
                k.value: v for k, v in zip(literal.keys, literal.values, strict=True) if isinstance(k, ast.Constant)
            }
    return found


def _stubs(argument: ast.expr, function: ast.AsyncFunctionDef | ast.FunctionDef, tree: ast.Module) -> list[str]:
    """The stubs an activity argument names: `contracts.x`, or a parameter given `contracts.x` by every caller."""
    if (
        isinstance(argument, ast.Attribute)
        and isinstance(argument.value, ast.Name)
        and argument.value.id == "contracts"
    ):
        return [argument.attr]
    if isinstance(argument, ast.Name) and argument.id in [a.arg for a in function.args.args]:
        position = [a.arg for a in function.args.args].index(argument.id) - 1  # after self
        given = [
            node.args[position]
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == function.name
            and len(node.args) > position
        ]
        assert given, f"{function.name} is never called"
        return [name for node in given for name in _stubs(node, function, tree)]
    raise AssertionError(
        f"an activity named by {ast.unparse(argument)}: call it through its stub in workflows.contracts"
    )


def calls_in(module: str, source: str) -> list[Call]:
    """Every activity the module's workflow calls, and the kind of queue each is sent to."""
    tree = ast.parse(source)
    found = set()  # a call in a lambda or a nested function is seen from each function around it
    for function in ast.walk(tree):
        if not isinstance(function, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        dicts = {
            target.id: node.value
            for node in ast.walk(function)
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)
        }
        for node in ast.walk(function):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("execute_activity", "start_activity", "execute_local_activity"):
                continue
            local = node.func.attr == "execute_local_activity"
            queue = "control" if local else _queue_kind(_options(node, dicts).get("task_queue"), dicts)
            for stub in _stubs(node.args[0], function, tree):
                found.add(Call(module, node.lineno, stub, queue))
    return sorted(found, key=lambda c: (c.line, c.activity))


def workflow_calls() -> list[Call]:
    return [call for m in WORKFLOW_MODULES for call in calls_in(m, (SOURCE / f"{m}.py").read_text())]


# ---- the checks --------------------------------------------------------------------------------------------------


def _hints(fn: Callable[..., Any]) -> tuple[list[Any], Any]:
    hints = typing.get_type_hints(fn)
    parameters = [p for p in inspect.signature(fn).parameters if p != "self"]
    return [hints.get(p) for p in parameters], hints.get("return")


def activity_problems(calls: list[Call], served: dict[str, Serves]) -> list[str]:
    """Every call whose activity the process polling its queue does not register, or registers with other types."""
    problems = []
    for call in calls:
        stub = getattr(contracts, call.activity, None)
        if stub is None:
            problems.append(f"{call.module}.py:{call.line}: contracts has no activity {call.activity}")
            continue
        name = contracts.activity_name(stub)
        registered = {_activity_name(fn): fn for fn in served[call.queue].activities}
        where = f"{call.module}.py:{call.line}: {name} on {served[call.queue].task_queue}"
        if name not in registered:
            problems.append(f"{where} is registered by no process polling it")
        elif _hints(registered[name]) != _hints(stub):
            problems.append(f"{where} takes or returns other types than its stub")
    return problems


def _activity_name(fn: Callable[..., Any]) -> str:
    definition = activity._Definition.must_from_callable(fn)
    assert definition.name is not None
    return definition.name


def handler_problems(
    served: Serves,
    signals: list[Any] = contracts.SIGNALS,
    queries: list[Any] = contracts.QUERIES,
    updates: list[Any] = contracts.UPDATES,
) -> list[str]:
    """Every signal, query or update declared whose workflow (registered on the control queue) has no such handler,
    or one with other types; and every handler not declared."""
    definitions = {d.name: d for d in (workflow._Definition.must_from_class(cls) for cls in served.workflows)}
    problems = []
    kinds = [("signal", signals, "signals"), ("query", queries, "queries"), ("update", updates, "updates")]
    for kind, declared, attribute in kinds:
        for message in declared:
            handlers = getattr(definitions[message.workflow], attribute)
            if message.name not in handlers:
                problems.append(f"{message.workflow} has no {kind} {message.name}")
                continue
            arguments, result = _hints(handlers[message.name].fn)
            expected = [] if message.input is None else [message.input]
            if arguments != expected or (kind != "signal" and result != message.result):
                problems.append(f"{message.workflow}'s {kind} {message.name} takes or returns other types")
        for workflow_name, definition in definitions.items():
            names = {m.name for m in declared if m.workflow == workflow_name}
            problems += [
                f"{workflow_name}'s {kind} {name} is not declared in contracts"
                for name in getattr(definition, attribute)
                if name is not None and name not in names
            ]
    return problems


# ---- the tests ---------------------------------------------------------------------------------------------------


def test_every_activity_a_workflow_calls_is_registered_on_the_queue_it_is_sent_to() -> None:
    calls = workflow_calls()
    assert {c.activity for c in calls} >= {"load_settings", "place", "release", "run_task", "hold_lease", "read_log"}
    assert "hold_scheduler_lease" in {c.activity for c in calls}
    assert activity_problems(calls, processes()) == []


def test_every_signal_query_and_update_is_handled_by_its_workflow_with_the_declared_types() -> None:
    assert handler_problems(processes()["control"]) == []


def test_the_processes_poll_the_queues_the_workflows_address() -> None:
    served = processes()
    assert [served[k].task_queue for k in ("control", "scheduler", "machine", "lease", "scheduler_lease")] == [
        contracts.CONTROL_TASK_QUEUE,
        contracts.SCHEDULER_TASK_QUEUE,
        contracts.node_task_queue(MACHINE),
        contracts.lease_task_queue(MACHINE, INSTANCE),
        contracts.scheduler_lease_task_queue(INSTANCE),
    ]
    defined = [workflow._Definition.must_from_class(cls).name for cls in served["control"].workflows]
    names = [contracts.JOB_WORKFLOW, contracts.NODE_WORKFLOW, contracts.LOGS_WORKFLOW, contracts.QUOTAS_WORKFLOW]
    names += [contracts.TOKENS_WORKFLOW, contracts.DELETE_RUN_WORKFLOW, contracts.DELETED_RUNS_WORKFLOW]
    names += [contracts.DRIVES_WORKFLOW, contracts.IDENTITY_WORKFLOW, contracts.SESSION_WORKFLOW]
    names += [contracts.SUBNETS_WORKFLOW, contracts.SCHEDULER_LEASE_WORKFLOW]
    assert (defined, contracts.IDENTITY_WORKFLOW) == (names, "IdentityWorkflow")
    assert contracts.SESSION_WORKFLOW == "SessionWorkflow"


def test_names_on_the_wire_are_those_the_committed_histories_and_running_clusters_use() -> None:
    """Changing one strands every run and machine that uses it: a new name is a new contract, behind a protocol."""
    served = processes()
    assert {k: sorted(_activity_name(fn) for fn in s.activities) for k, s in served.items()} == {
        "control": [
            *("cancel_run_workflow", "end_run", "forget_run", "issue_identity", "load_settings", "machine_lost"),
            *("place", "release"),
        ],
        "scheduler": [
            *("drive_users", "drives_changed", "machine_heard", "machine_lost", "node_changed", "place"),
            *("plan_workers", "quotas_changed", "release"),
        ],
        "machine": [
            *("attach_session", "delete_run_files", "grant_session", "read_log", "run_task", "start_task"),
            *("stop_task", "supervise_task", "use_data_location"),
        ],
        "lease": ["hold_lease"],
        "scheduler_lease": ["hold_scheduler_lease"],
    }
    # Stubs renamed in Python keep the names histories recorded.
    renamed = [contracts.plan_group, contracts.tell_runs_machine_lost]
    assert [contracts.activity_name(stub) for stub in renamed] == ["plan_workers", "machine_lost"]
    assert [m.name for m in contracts.SIGNALS] == [
        "placement",
        "preempt",
        "task_progress",
        "task_running",
        "task_health",
        "machine_lost",
        "machine_heard",
        "task_exited_while_lost",
    ]
    assert [m.name for m in contracts.QUERIES] == [
        "status",
        "describe",
        "events",
        "folded",
        "attempts_on",
        "scheduler_view",
        "view",
        "quotas",
        "tokens",
        "tombstones",
        "drives",
        "subnets",
        "mesh_peers",
        "lease",
    ]
    assert [m.name for m in contracts.UPDATES] == [
        "cancel",
        "stop_task",
        "register",
        "report_gpus",
        "report_pressure",
        "report_orphan_stopped",
        "report_data",
        "set_data_location",
        "cordon",
        "uncordon",
        "remove",
        "set_quota",
        "remove_quota",
        "add_token",
        "revoke_token",
        "delete",
        "add_tombstone",
        "create_drive",
        "remove_drive",
        "report_drive",
        "assign_subnet",
        "free_subnet",
        "claim",
    ]
    assert (contracts.CONTROL_TASK_QUEUE, contracts.SCHEDULER_TASK_QUEUE) == ("astraeus-control", "astraeus-scheduler")
    assert (contracts.node_task_queue("m1"), contracts.lease_task_queue("m1", "h:1:t")) == (
        "astraeus-node-m1",
        "astraeus-node-m1@h:1:t",
    )
    assert (contracts.job_id("ns", "run"), contracts.node_id("m1"), contracts.QUOTAS_WORKFLOW_ID) == (
        "job/ns/run",
        "node/m1",
        "quotas",
    )
    assert (contracts.TOKENS_WORKFLOW, contracts.TOKENS_WORKFLOW_ID) == ("TokensWorkflow", "tokens")
    assert (contracts.DRIVES_WORKFLOW, contracts.DRIVES_WORKFLOW_ID) == ("DrivesWorkflow", "drives")
    assert (contracts.SUBNETS_WORKFLOW, contracts.SUBNETS_WORKFLOW_ID) == ("SubnetsWorkflow", "subnets")
    assert (contracts.SCHEDULER_LEASE_WORKFLOW, contracts.SCHEDULER_LEASE_WORKFLOW_ID) == (
        "SchedulerLeaseWorkflow",
        "scheduler",
    )
    assert contracts.scheduler_lease_task_queue("h:1:t") == "astraeus-scheduler@h:1:t"
    assert [contracts.SA_NAMESPACE, contracts.SA_STATE, contracts.SA_PRIORITY, contracts.SA_NODES] == [
        "AstraeusNamespace",
        "AstraeusState",
        "AstraeusPriority",
        "AstraeusNodes",
    ]


# ---- each check fails when a name changes ------------------------------------------------------------------------


@activity.defn(name="run_task_v2")
async def _renamed_run_task(input: Any) -> Any:
    raise NotImplementedError


def test_an_activity_renamed_by_the_process_that_serves_it_is_caught() -> None:
    served = processes()
    machine = served["machine"]
    renamed = [_renamed_run_task if _activity_name(fn) == "run_task" else fn for fn in machine.activities]
    served["machine"] = replace(machine, activities=renamed)
    problems = activity_problems(workflow_calls(), served)
    assert problems and all(
        "run_task on astraeus-node-m1 is registered by no process polling it" in p for p in problems
    )


@activity.defn(name="plan_workers")
async def _plan_group_retyped(input: PlaceInput) -> PlaceResult:
    raise NotImplementedError


def test_an_activity_whose_types_differ_from_its_stub_is_caught() -> None:
    served = processes()
    retyped = _plan_group_retyped
    scheduler = served["scheduler"]
    served["scheduler"] = replace(
        scheduler, activities=[retyped if _activity_name(fn) == "plan_workers" else fn for fn in scheduler.activities]
    )
    assert [p.split(": ", 1)[1] for p in activity_problems(workflow_calls(), served)] == [
        "plan_workers on astraeus-scheduler takes or returns other types than its stub"
    ]


# A workflow's call, as the workflows write it; each case changes one name in it.
PLAN = """
async def _plan(self, command):
    plan = await workflow.execute_activity(contracts.plan_group, message, task_queue=SCHEDULER_TASK_QUEUE)
"""


def test_a_workflow_call_written_as_the_workflows_write_it_passes() -> None:
    assert activity_problems(calls_in("plan", PLAN), processes()) == []


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        pytest.param(
            "contracts.plan_group",
            '"plan_workers"',
            "an activity named by 'plan_workers'",
            id="an activity named by a string literal",
        ),
        pytest.param(
            "contracts.plan_group",
            "contracts.plan_the_group",
            "contracts has no activity plan_the_group",
            id="an activity contracts does not declare",
        ),
        pytest.param(
            "contracts.plan_group",
            "contracts.read_log",
            "read_log on astraeus-scheduler is registered by no process polling it",
            id="an activity sent to a queue whose process does not serve it",
        ),
        pytest.param(
            "SCHEDULER_TASK_QUEUE",
            "node_task_queue(command.node)",
            "plan_workers on astraeus-node-m1 is registered by no process polling it",
            id="a queue whose process does not serve the activity",
        ),
        pytest.param(
            "SCHEDULER_TASK_QUEUE",
            '"astraeus-scheduler"',
            "a task queue named by 'astraeus-scheduler'",
            id="a task queue named by a string literal",
        ),
    ],
)
def test_a_workflow_that_calls_a_name_no_process_serves_is_caught(old: str, new: str, problem: str) -> None:
    try:
        problems = activity_problems(calls_in("plan", PLAN.replace(old, new)), processes())
    except AssertionError as refused:
        problems = [str(refused)]
    assert any(problem in p for p in problems), problems


def test_a_signal_renamed_on_either_side_is_caught() -> None:
    renamed = replace(contracts.TASK_RUNNING, name="task_started")
    signals = [renamed if s is contracts.TASK_RUNNING else s for s in contracts.SIGNALS]
    assert handler_problems(processes()["control"], signals=signals) == [
        "JobWorkflow has no signal task_started",
        "JobWorkflow's signal task_running is not declared in contracts",
    ]
