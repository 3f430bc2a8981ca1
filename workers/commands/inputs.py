"""What the command line gives the verbs: paths, the settings and a run spec read from files, a run's name, numbers
and sizes, each checked where it enters."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml
from pydantic import ByteSize, TypeAdapter, ValidationError

from workers.errors import AstraeusError
from workflows.domain.run.status import RunState
from workflows.domain.run.views import TERMINATED
from workflows.domain.settings import Settings
from workflows.domain.spec import JobSpec, format_errors, parse_spec

RUN_STATES = [*(s.value for s in RunState), TERMINATED]  # what `ls --state` and `wait --for` accept


def given_path(value: str) -> Path:
    """A path given on the command line, made absolute where it enters: the processes it is handed to (a worker's
    shim, the Temporal server) start in other directories."""
    return Path(value).expanduser().resolve()


def load_settings(path: str | None) -> Settings:
    """`--settings FILE`: YAML overriding the settings model; unknown keys are errors."""
    if path is None:
        return Settings()
    try:
        data = yaml.safe_load(given_path(path).read_text()) or {}
        return Settings.model_validate(data)
    except (OSError, yaml.YAMLError) as error:
        raise AstraeusError(f"--settings {path}: {error}") from None
    except ValidationError as error:
        raise AstraeusError(f"--settings {path}:\n{format_errors(error)}") from None


def load_spec(path: str) -> JobSpec:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise AstraeusError(f"{path}: {error}") from None
    try:
        return parse_spec(data)
    except ValueError as error:
        raise AstraeusError(f"{path}: invalid run spec:\n{error}") from None


def split_run(run: str, namespace: str) -> tuple[str, str]:
    """`name` (in --namespace), `namespace/name` (as `submit` prints it), or the run's workflow id
    `job/namespace/name` (as the Temporal UI shows it)."""
    parts = run.split("/")
    if len(parts) == 3 and parts[0] == "job":
        parts = parts[1:]
    if len(parts) == 2:
        return parts[0], parts[1]
    if len(parts) == 1:
        return namespace, run
    raise AstraeusError(f"{run}: expected NAME, NAMESPACE/NAME or job/NAMESPACE/NAME")


def seconds(value: str) -> float:
    """`--timeout`: seconds, 0 or more."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{value!r}: expected seconds, 0 or more")
    return number


def positive(value: str) -> int:
    """`--limit`: a count, 1 or more."""
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number, 1 or more")
    return int(value)


def natural(value: str) -> int:
    """`--after`: a count, 0 or more."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: expected a number, 0 or more")
    return int(value)


def byte_size(value: str) -> int:
    """A size on the command line: bytes, or with a unit (`64GiB`, `512MiB`, `80GB`)."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(value))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected a size, e.g. 68719476736, 64GiB or 512MiB") from None


CA_DIR_HELP = (
    "the cluster CA's directory, its key readable by its owner only (default $ASTRAEUS_CA_DIR, else .astraeus/ca)"
)


def ca_dir(given: str | None) -> Path:
    """--ca-dir, else $ASTRAEUS_CA_DIR, else .astraeus/ca: where the control plane keeps the cluster CA."""
    from activities.control import DEFAULT_CA_DIR

    return given_path(given or os.environ.get("ASTRAEUS_CA_DIR") or str(DEFAULT_CA_DIR))
