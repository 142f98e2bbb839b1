"""An engine of the test's own on a real loopback socket, for tests that put the router in
front of it: every request is answered by a function of the test's, which gets the request
as httpx builds one and gives an httpx.Response (its content may be an async stream: it is
sent piece by piece as it comes, in HTTP/1.1 chunks, on a kept-alive connection). Served
over TLS, it stands for a host's ingress: each request then carries the certificate the
router presented (DER) as its extension `peercert`."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

Answer = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]
# What the answer's headers may not say: the fake engine frames the body itself.
FRAMING = ("content-length", "transfer-encoding")


@contextlib.asynccontextmanager
async def engine_serving(answer: Answer, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """Serve `answer` on a free loopback port (yielded) until the block ends; over TLS with
    the server context `tls`."""
    handlers: set[asyncio.Task[None]] = set()

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            while await _one(answer, port, reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the router closed the connection: a client left, or it was done with it
        except asyncio.CancelledError:
            pass  # the block ended: asyncio's stream server takes a cancelled handler as failed
        finally:
            handlers.discard(task)
            writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0, ssl=tls)
    port = int(server.sockets[0].getsockname()[1])
    try:
        yield port
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def _one(
    answer: Answer, port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> bool:
    """Read one request and send its answer; False when the router closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    first, *lines = head.decode("latin-1").split("\r\n")
    method, target, _ = first.split(" ", 2)
    headers = [(name.strip(), value.strip()) for name, value in _fields(lines)]
    length = next((int(v) for k, v in headers if k.lower() == "content-length"), 0)
    body = await reader.readexactly(length)
    peer = writer.get_extra_info("ssl_object")
    request = httpx.Request(
        method,
        f"http://127.0.0.1:{port}{target}",
        headers=headers,
        content=body,
        extensions={"peercert": peer.getpeercert(binary_form=True)} if peer else {},
    )
    found = answer(request)
    response = await found if inspect.isawaitable(found) else found
    kept = [f"{k}: {v}" for k, v in response.headers.items() if k.lower() not in FRAMING]
    status = f"HTTP/1.1 {response.status_code} {response.reason_phrase}"
    writer.write("\r\n".join([status, *kept, "transfer-encoding: chunked", "", ""]).encode())
    async for piece in response.aiter_bytes():
        if piece:
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
    writer.write(b"0\r\n\r\n")
    await writer.drain()
    return True


def _fields(lines: list[str]) -> list[tuple[str, str]]:
    return [(line.split(":", 1)[0], line.split(":", 1)[1]) for line in lines if ":" in line]


class RawEngine:
    """A loopback HTTP/1.1 server that answers every request with the same bytes (`answer`,
    status line and head included) on a kept-alive connection, counting the connections it
    was given, the requests, and the connections that ended."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.ended = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                )
                await reader.readexactly(length)
                self.requests += 1
                writer.write(self.answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.ended += 1
            writer.close()
