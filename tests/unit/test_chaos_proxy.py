"""The chaos suite's fault proxy on real loopback sockets: bytes pass, a partition holds them back until it
heals (then they arrive, as TCP delivers them), a reset cuts open connections and new ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from llmbatch.chaos.proxy import FaultProxy

pytestmark = pytest.mark.unit


@pytest.fixture
async def proxy() -> AsyncIterator[FaultProxy]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    p = FaultProxy("127.0.0.1", int(server.sockets[0].getsockname()[1]))
    await p.start()
    yield p
    await p.close()
    server.close()
    await server.wait_closed()


async def _connect(p: FaultProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", p.port)


async def test_bytes_pass_and_a_partition_delivers_them_once_it_heals(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    proxy.partition()
    writer.write(b"held")
    answer = asyncio.create_task(reader.readexactly(4))
    late_r, late_w = await _connect(proxy)  # a connection made during the partition is taken, not refused
    late_w.write(b"late")
    proxy.heal()
    assert await answer == b"held"
    assert await late_r.readexactly(4) == b"late"
    for w in (writer, late_w):
        w.close()


async def test_a_reset_cuts_open_connections_and_new_ones(proxy: FaultProxy) -> None:
    reader, writer = await _connect(proxy)
    writer.write(b"ping")
    assert await reader.readexactly(4) == b"ping"
    proxy.reset()
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await reader.readexactly(1)  # the connection was cut mid-conversation
    new_r, new_w = await _connect(proxy)
    new_w.write(b"x")
    with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
        await new_r.readexactly(1)
    proxy.heal()
    again_r, again_w = await _connect(proxy)
    again_w.write(b"back")
    assert await again_r.readexactly(4) == b"back"
    again_w.close()
