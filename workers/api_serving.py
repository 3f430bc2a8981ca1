"""Where the HTTP API listens: its socket, bound at once (a port in use is said, naming it), and uvicorn serving on
it."""

import asyncio
import contextlib
import errno
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from workers.api_answers import (
    BadInput,
    PortInUse,
)
from workers.errors import AstraeusError

DEFAULT_LISTEN = "127.0.0.1:7245"  # `astraeus api --listen` (the scheduler's door is 7244)


async def serve(app: FastAPI, sock: socket.socket, stop: asyncio.Event | None = None) -> None:
    """Serve the API on a bound socket: until SIGINT or SIGTERM (uvicorn's own handlers), or, in a process that
    keeps its own handlers (`astraeus dev`), until `stop` is set."""
    config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, server_header=False)
    server = uvicorn.Server(config) if stop is None else _OwnSignals(config)
    sock.listen(1024)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    if stop is not None:
        await stop.wait()
        server.should_exit = True
    await serving


class _OwnSignals(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the process's own handlers stay


def bind(address: str) -> socket.socket:
    """A socket bound to HOST:PORT, so that a port in use is said at once, naming it."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise BadInput(f"--listen {address}: expected HOST:PORT, e.g. {DEFAULT_LISTEN}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), int(port)))
    except OSError as error:
        sock.close()
        kind = PortInUse if error.errno == errno.EADDRINUSE else AstraeusError
        raise kind(f"the API cannot listen on {address}: {error.strerror}") from None
    return sock
