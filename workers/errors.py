"""What the client's verbs raise, shared by every door (the CLI, the HTTP API, the Python client): the message says
what is wrong."""

from __future__ import annotations


class AstraeusError(Exception):
    """Bad input: the message names what is wrong; nothing changed."""


class NotFound(AstraeusError):
    """No such run, worker, machine or quota."""


class Unreachable(AstraeusError):
    """Temporal cannot be reached."""


class SessionRefused(AstraeusError):
    """An interactive token refused, or a worker that hosts no session: the message says why."""
