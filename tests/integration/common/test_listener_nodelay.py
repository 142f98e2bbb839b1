"""A service's listener hands out connections with Nagle's algorithm off. With it on, an
answer written in two parts (head, then body) waits for the client's delayed ACK before its
second part leaves: up to 40 ms on every request of a kept-alive connection."""

from __future__ import annotations

import asyncio
import socket

import pytest

from capycommon.httpserve import bind
from ports import free_port


@pytest.mark.anyio
async def test_connections_accepted_from_a_service_listener_have_nagle_off() -> None:
    listener = bind(f"127.0.0.1:{free_port()}")
    accepted: asyncio.Queue[int] = asyncio.Queue()

    def made(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        accepted.put_nowait(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(made, sock=listener)
    try:
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        nodelay = await asyncio.wait_for(accepted.get(), 5)
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
    assert nodelay != 0
