"""The pure core's layers, read from its imports: `workflows/domain/` imports nothing of the shells (the workflows,
activities and workers); its floor (the modules directly in it) imports no wing; the run's wing and the scheduler's
do not import each other; and the machine's wing imports neither. Every import counts, in functions and under
TYPE_CHECKING too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOMAIN = ROOT / "workflows" / "domain"
WINGS = ("run", "scheduling", "machine")

# (importer's wing, imported wing) that may not meet
APART = [("run", "scheduling"), ("scheduling", "run"), ("machine", "run"), ("machine", "scheduling")]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, name: str, is_package: bool = False) -> list[tuple[int, str]]:
    """Every module `source` (the module `name`) imports, with its line; `from package import module` names the
    module (it may be one), relative imports are made absolute."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")[: None if is_package else -1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, *([module] if module else [])])
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def place(module: str) -> str | None:
    """Where a module lies: "floor", a wing's name, "outside" (the shells: workflows, activities, workers) or None
    (the standard library and third parties)."""
    parts = module.split(".")
    if parts[:2] == ["workflows", "domain"]:
        return parts[2] if len(parts) >= 3 and parts[2] in WINGS else "floor"
    if parts[0] in ("workflows", "activities", "workers"):
        return "outside"
    return None


def domain_imports() -> list[tuple[str, int, str]]:
    """(importer, line, imported) for every import in workflows/domain."""
    found = []
    for path in sorted(DOMAIN.rglob("*.py")):
        name = module_name(path)
        found += [(name, line, imported) for line, imported in imports(path.read_text(), name, path.stem == "__init__")]
    return found


def violations(found: list[tuple[str, int, str]]) -> list[str]:
    """Each import that crosses a layer the wrong way, as `importer:line imports imported`."""
    wrong = []
    for importer, line, imported in found:
        here, there = place(importer), place(imported)
        if there is None or there == here:
            continue
        if there == "outside":
            wrong.append(f"{importer}:{line} imports {imported}: the pure core imports no shell")
        elif here == "floor":
            wrong.append(f"{importer}:{line} imports {imported}: the floor imports no wing")
        elif (here, there) in APART:
            wrong.append(f"{importer}:{line} imports {imported}: {here}/ does not import {there}/")
    return wrong


def test_the_domain_has_its_wings_and_a_floor() -> None:
    for wing in WINGS:
        assert (DOMAIN / wing / "__init__.py").is_file(), wing
    assert len(list(DOMAIN.glob("*.py"))) > 5


def test_the_domain_imports_no_shell_and_no_wing_the_wrong_way() -> None:
    found = domain_imports()
    assert len(found) > 100  # the walk reads the imports
    assert violations(found) == []


@pytest.mark.parametrize(
    ("importer", "source", "problem"),
    [
        pytest.param(
            "workflows.domain.spec",
            "from workflows.domain.run.status import JobRecord",
            "the floor imports no wing",
            id="the floor importing the run's status is refused",
        ),
        pytest.param(
            "workflows.domain.run.job",
            "from workflows.domain.scheduling import placement",
            "run/ does not import scheduling/",
            id="the run importing the scheduler's placement is refused",
        ),
        pytest.param(
            "workflows.domain.scheduling.queue",
            "import workflows.domain.run.events",
            "scheduling/ does not import run/",
            id="the scheduler importing the run's events is refused",
        ),
        pytest.param(
            "workflows.domain.machine.decisions",
            "from ..run import status",
            "machine/ does not import run/",
            id="the machine importing the run, relatively, is refused",
        ),
        pytest.param(
            "workflows.domain.machine.decisions",
            "from workflows.domain.scheduling.machines import Cluster",
            "machine/ does not import scheduling/",
            id="the machine importing the scheduler is refused",
        ),
        pytest.param(
            "workflows.domain.run.job",
            "def f():\n    from workflows import contracts",
            "the pure core imports no shell",
            id="the core importing a workflow shell in a function is refused",
        ),
        pytest.param(
            "workflows.domain.reasons",
            "from activities.agent import AgentActivities",
            "the pure core imports no shell",
            id="the core importing an activity is refused",
        ),
        pytest.param(
            "workflows.domain.run.job",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from workers.cli import main",
            "the pure core imports no shell",
            id="the core importing the workers under TYPE_CHECKING is refused",
        ),
    ],
)
def test_a_crossing_is_named(importer: str, source: str, problem: str) -> None:
    found = [(importer, line, imported) for line, imported in imports(source, importer)]
    assert [v.split(": ", 1)[1] for v in violations(found)] == [problem]


@pytest.mark.parametrize(
    ("importer", "source"),
    [
        ("workflows.domain.run.job", "from workflows.domain.reasons import R"),
        ("workflows.domain.scheduling.queue", "from workflows.domain.scheduling import gang_placement"),
        ("workflows.domain.machine.decisions", "from workflows.domain.inventory import NodeView"),
        ("workflows.domain.spec", "from pydantic import BaseModel"),
    ],
    ids=["a wing imports the floor", "a wing imports itself", "the machine imports the floor", "a third party"],
)
def test_what_is_allowed_passes(importer: str, source: str) -> None:
    found = [(importer, line, imported) for line, imported in imports(source, importer)]
    assert violations(found) == []


def test_what_the_control_plane_and_the_scheduler_use_imports_nothing_of_the_agents_wing() -> None:
    """`activities/` keeps what the control plane and the scheduler use; the machine's side is `activities/agent/`,
    which they never need."""
    shared = sorted((ROOT / "activities").glob("*.py"))
    assert shared, "activities/ has modules"
    wrong = [
        f"{module_name(path)}:{line} imports {imported}"
        for path in shared
        for line, imported in imports(path.read_text(), module_name(path), path.stem == "__init__")
        if imported.startswith("activities.agent")
    ]
    assert wrong == []
