"""A TCP proxy on loopback that can be cut, for the chaos suite's partition: one agent reaches Temporal through it.

Cut, it passes nothing either way and closes nothing, as a network that drops every packet: it stops reading from
both sides of every connection (what was sent waits in the kernel's buffers, as TCP retransmits it over a dropped
path), and a new connection is accepted but not carried on to the server. Healed, everything held goes through, as
TCP delivers it once the path is back, unless an end gave up on its connection meanwhile (its close then arrives
too). Nothing here closes a connection because of the cut.
"""

from __future__ import annotations

import asyncio
import contextlib

CHUNK = 65536


class TcpProxy:
    """`127.0.0.1:<port>` forwarding to `upstream_host:upstream_port`; `cut()` and `heal()` as above."""

    def __init__(self, upstream_host: str, upstream_port: int, port: int = 0) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = port
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted so far
        self.cut_count = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def cut(self) -> None:
        """From now on nothing passes, either way, on any connection, old or new."""
        self._open.clear()
        self.cut_count += 1

    def heal(self) -> None:
        """Everything held passes again."""
        self._open.set()

    async def close(self) -> None:
        """Stop listening and close every connection (healed first, so that nothing waits on the cut)."""
        self._open.set()
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            await self._open.wait()  # a connection made while cut waits, open, for the path to come back
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return  # the server is away: refused, as it would be without the proxy
            self._writers.add(up_writer)
            try:
                await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
            finally:
                self._writers.discard(up_writer)
                up_writer.close()
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction while open; cut, neither read nor write (a chunk read just before waits)."""
        try:
            while True:
                await self._open.wait()
                data = await reader.read(CHUNK)
                await self._open.wait()
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            writer.close()
