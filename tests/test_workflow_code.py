"""The workflows' code reads no clock, no randomness and no outside world: the control plane runs it outside the
SDK's sandbox (`workers/services.py: WORKFLOW_RUNNER`), so what the sandbox would refuse at run time is refused here,
in every module under `workflows/`, as well as by the workflow tests, which run the workflows in the full sandbox."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"

# Modules whose functions give the same answer on replay: no I/O, no clock, no randomness. Add one only if so.
IMPORTABLE = {
    "__future__", "abc", "asyncio", "bisect", "collections", "contextlib", "copy", "dataclasses", "datetime",
    "decimal", "enum", "fnmatch", "fractions", "functools", "hashlib", "heapq", "ipaddress", "itertools", "json",
    "math", "operator", "posixpath", "pydantic", "re", "string", "temporalio", "textwrap", "types", "typing",
    "urllib.parse", "workflows", "zlib",
}  # fmt: skip

# Calls that read the clock, randomness or the outside world, by the last parts of their dotted name
REFUSED_CALLS = {
    ("datetime", "now"): "workflow.now()",
    ("datetime", "utcnow"): "workflow.now()",
    ("datetime", "today"): "workflow.now()",
    ("date", "today"): "workflow.now()",
    ("open",): "an activity",
    ("input",): "an activity",
}


def problems(source: str, name: str = "<code>") -> list[str]:
    """What in `source` the workflows may not do, one line each (`name:line: why`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{name}:{node.lineno}: imports {a.name}" for a in node.names if not _importable(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and not _importable(node.module):
            found.append(f"{name}:{node.lineno}: imports {node.module}")
        elif isinstance(node, ast.Call):
            dotted = _dotted(node.func)
            for tail, instead in REFUSED_CALLS.items():
                if dotted[-len(tail) :] == tail and (len(tail) > 1 or len(dotted) == 1):
                    found.append(f"{name}:{node.lineno}: calls {'.'.join(dotted)} (use {instead})")
    return found


def _importable(module: str) -> bool:
    return any(module == allowed or module.startswith(f"{allowed}.") for allowed in IMPORTABLE)


def _dotted(func: ast.expr) -> tuple[str, ...]:
    parts: list[str] = []
    while isinstance(func, ast.Attribute):
        parts.insert(0, func.attr)
        func = func.value
    return (func.id, *parts) if isinstance(func, ast.Name) else tuple(parts)


def test_no_workflow_module_reads_a_clock_randomness_or_the_outside_world() -> None:
    modules = sorted(WORKFLOWS.rglob("*.py"))
    assert len(modules) > 20
    found = [line for path in modules for line in problems(path.read_text(), str(path.relative_to(WORKFLOWS)))]
    assert found == []


@pytest.mark.parametrize(
    ("code", "problem"),
    [
        ("from datetime import datetime\nat = datetime.now()", "<code>:2: calls datetime.now (use workflow.now())"),
        ("import datetime as dt\nat = dt.datetime.today()", "<code>:2: calls dt.datetime.today (use workflow.now())"),
        ("import random", "<code>:1: imports random"),
        ("from uuid import uuid4", "<code>:1: imports uuid"),
        ("import time", "<code>:1: imports time"),
        ("from urllib.request import urlopen", "<code>:1: imports urllib.request"),
        ("from activities.agent import AgentActivities", "<code>:1: imports activities.agent"),
        ("text = open('f').read()", "<code>:1: calls open (use an activity)"),
    ],
)  # fmt: skip
def test_what_the_sandbox_would_refuse_is_caught(code: str, problem: str) -> None:
    assert problems(code) == [problem]


def test_what_the_workflows_do_passes() -> None:
    code = "from urllib.parse import unquote\nfrom temporalio import workflow\nat = workflow.now()\nf.open()"
    assert problems(code) == []
