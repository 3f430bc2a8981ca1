"""Every example run spec is a valid spec: the README and the tour submit them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from workflows.domain.spec import parse_spec

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_an_example_is_a_valid_run_spec(path: Path) -> None:
    spec = parse_spec(yaml.safe_load(path.read_text()))

    assert spec.name == path.stem
