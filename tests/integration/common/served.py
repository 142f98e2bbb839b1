"""An ASGI app served in this test's event loop the way a service serves it (`serve_http` on
a real socket), and raw HTTP/1.1 over asyncio streams for what no HTTP client sends."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

from capycommon.httpserve import serve_http
from capycommon.settings import ConnectionLimits
from support import wait_for_async

HOST = "127.0.0.1"


@contextlib.asynccontextmanager
async def served(app: Any, limits: ConnectionLimits) -> AsyncIterator[int]:
    """`app` listening on a loopback port the system chose (yielded) until the block ends:
    the listener is bound before its port is known, so no other process can take it."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.bind((HOST, 0))
    listener.listen(2048)
    port = int(listener.getsockname()[1])
    stop = asyncio.Event()
    serving = asyncio.create_task(serve_http(app, f"{HOST}:{port}", stop, limits, listener))

    async def accepting() -> bool:
        with contextlib.suppress(ConnectionRefusedError):
            async with connected(port):
                return True
        return False

    try:
        await wait_for_async(accepting, timeout=10, what="the listener")
        yield port
    finally:
        stop.set()
        await serving


@contextlib.asynccontextmanager
async def connected(
    port: int, source: str = HOST
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A connection to the listener from `source` (any 127.0.0.0/8 address on Linux), closed
    when the block ends."""
    reader, writer = await asyncio.open_connection(HOST, port, local_addr=(source, 0))
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def request_head(method: str, path: str, **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chat_head(api_key: str, length: int) -> bytes:
    """The head of a chat completion whose JSON body is `length` bytes, sent with `api_key`."""
    return request_head(
        "POST",
        "/v1/chat/completions",
        Authorization=f"Bearer {api_key}",
        Content_Type="application/json",
        Content_Length=str(length),
    )


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response's status and body (sized by its Content-Length)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return status, await reader.readexactly(length)


async def closed_after(reader: asyncio.StreamReader) -> float:
    """Seconds until the server closes the connection (reading and dropping anything)."""
    started = asyncio.get_running_loop().time()
    with contextlib.suppress(ConnectionResetError):
        while await reader.read(65536):
            pass
    return asyncio.get_running_loop().time() - started
