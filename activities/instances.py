"""A long-running process as a lease names it ("host:pid:token"): an agent holding its machine, a scheduler holding the
scheduler's lease. A holder of this host whose process no longer runs is gone: its lease is taken over at once
instead of waiting out its TTL."""

from __future__ import annotations

import os
import secrets
import socket


def new_instance() -> str:
    """This process, as a lease names it: host, process id and a token of its own."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def gone(holder: str) -> bool:
    """Whether the holder `holder` ("host:pid:token") was a process of this host that no longer runs."""
    host, _, rest = holder.partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # it runs, as another user
    return False
