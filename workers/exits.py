"""The CLI's exit codes, in one place: what a script or a CI job reads from `astraeus` (the README lists them)."""

from __future__ import annotations

from enum import IntEnum

from workflows.domain.run.status import RunState
from workflows.domain.run.views import TERMINATED


class ExitCode(IntEnum):
    OK = 0  # the verb did what was asked; a run read or waited for is Completed (or has not ended)
    FAILED = 1  # the run Failed
    BAD_INPUT = 2  # an invalid spec, flag or value: nothing was changed (argparse's own code for a usage error)
    NOT_FOUND = 3  # no such run, worker, machine or quota
    UNREACHABLE = 4  # Temporal cannot be reached (or stopped answering)
    CANCELLED = 5  # the run was Cancelled
    TERMINATED = 6  # the run's workflow was terminated in Temporal
    TIMEOUT = 7  # `wait --timeout`: the run did not get there in time
    INTERRUPTED = 130  # Ctrl-C
    CLOSED_PIPE = 141  # the reader of the output went away (`| head`): as a Unix tool killed by SIGPIPE


def exit_for_state(state: str) -> ExitCode:
    """How a verb that reads or waits for a run exits, by the run's state: non-zero only for a run that ended other
    than Completed."""
    return {
        RunState.FAILED: ExitCode.FAILED,
        RunState.CANCELLED: ExitCode.CANCELLED,
        TERMINATED: ExitCode.TERMINATED,
    }.get(state, ExitCode.OK)
