"""The bounds of every field of a run spec, in one place (the README's spec reference lists them).

Every number of a spec feeds arithmetic (timers, sums of room, estimates of when work ends) and every string and
list is carried in the run's record, which one workflow holds and continues as new. A value past its bound is
refused at submit, naming the field, so that nothing a user writes can overflow a date or a timer inside the
scheduler or a run's workflow.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints

DAY_SECONDS = 24 * 3600
YEAR_SECONDS = 365 * DAY_SECONDS
MAX_TIME_LIMIT_SECONDS = YEAR_SECONDS  # time_limit_seconds
MAX_HEARTBEAT_TTL_SECONDS = DAY_SECONDS  # heartbeat_ttl_seconds: a day
MAX_PATIENCE_SECONDS = DAY_SECONDS  # topology.patience_seconds: a day
MAX_WORKERS = 1000  # workers of one run (replicas summed over groups; machines of a group of total_gpus)
MAX_PRIORITY = 1_000_000
MAX_BYTES = 4 * 2**50  # memory_bytes, min_memory_bytes: 4 PiB
SPEC_MAX_BYTES = 128 * 1024  # the whole spec, as JSON
ENV_MAX_BYTES = 64 * 1024  # a group's env: names and values, as a process receives them
ENV_MAX_VARIABLES = 512
ARGUMENTS_MAX = 1024  # items of a command
ARGUMENT_MAX_CHARS = 32 * 1024  # one argument, one variable's value
ENV_NAME_MAX_CHARS = 255
IMAGE_MAX_CHARS = 512
LEADER_MAX_CHARS = 68  # a group's name (63), a dash and an index below MAX_WORKERS
PATH_MAX_CHARS = 4096  # PATH_MAX
LABEL_MAX_CHARS = 253  # a machine's name, a label's key or value, a GPU's vendor or model (a DNS name's length)
POOL_MAX_CHARS = 63
SELECTED_MAX = 256  # names, labels or pools one selection lists
GPU_MODELS_MAX = 32

Argument = Annotated[str, StringConstraints(max_length=ARGUMENT_MAX_CHARS)]
Arguments = Annotated[list[Argument], Field(min_length=1, max_length=ARGUMENTS_MAX)]
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=ENV_NAME_MAX_CHARS)]
EnvValue = Annotated[str, StringConstraints(max_length=ARGUMENT_MAX_CHARS)]
PathText = Annotated[str, StringConstraints(max_length=PATH_MAX_CHARS)]
Label = Annotated[str, StringConstraints(max_length=LABEL_MAX_CHARS)]
Pool = Annotated[str, StringConstraints(max_length=POOL_MAX_CHARS)]
