"""bench.proxy: the partition's TCP proxy passes bytes both ways, holds them while cut without closing anything, and
delivers what it held once healed; a connection made while cut waits for the heal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from bench.proxy import TcpProxy

HELD = 0.3  # seconds in which nothing may come back while cut


@pytest.fixture
async def echo() -> AsyncIterator[int]:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    yield int(server.sockets[0].getsockname()[1])
    server.close()


@pytest.fixture
async def proxy(echo: int) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy("127.0.0.1", echo)
    await proxy.start()
    yield proxy
    await proxy.close()


async def roundtrip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> bytes:
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), 2)


async def test_bytes_pass_both_ways(proxy: TcpProxy) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    assert await roundtrip(reader, writer, b"hello") == b"hello"
    writer.close()


async def test_cut_holds_everything_without_closing_and_heal_delivers_it(proxy: TcpProxy) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
    assert await roundtrip(reader, writer, b"before") == b"before"
    proxy.cut()
    assert proxy.is_cut
    writer.write(b"during")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(6), HELD)
    assert not reader.at_eof()  # nothing closed
    proxy.heal()
    assert await asyncio.wait_for(reader.readexactly(6), 2) == b"during"
    assert await roundtrip(reader, writer, b"after") == b"after"
    writer.close()


async def test_a_connection_made_while_cut_waits_for_the_heal(proxy: TcpProxy) -> None:
    proxy.cut()
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)  # accepted, as a SYN-less drop is not
    writer.write(b"new")
    await writer.drain()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.readexactly(3), HELD)
    proxy.heal()
    assert await asyncio.wait_for(reader.readexactly(3), 2) == b"new"
    writer.close()


async def test_a_server_away_refuses_through_the_proxy() -> None:
    proxy = TcpProxy("127.0.0.1", 1)  # nothing listens on port 1
    await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        assert await asyncio.wait_for(reader.read(10), 2) == b""  # closed at once
        writer.close()
    finally:
        await proxy.close()
