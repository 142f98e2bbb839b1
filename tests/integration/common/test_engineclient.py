"""The client to engines (the router's, and a host's ingress's), against real HTTP/1.1
servers on loopback sockets: a request goes out with its Host, Content-Type and length and
the caller's headers, an answer arrives whole however long and however slowly it is read, a
connection is reused only while the engine would keep it, an answer abandoned before its end
closes its connection, and every failure of the engine's side is an EngineConnectionError
that says what happened. Its TLS to a host's ingress is tested with the router in front of
one (test_host_ingress_client.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from capycommon.engineclient import HIGH_WATER, EngineConnectionError, Engines
from integration.router.fakeengine import RawEngine, engine_serving


def _counted(body: bytes) -> RawEngine:
    """An engine answering `body` to every request, framed by Content-Length."""
    return RawEngine(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


async def _serving(counted: RawEngine) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(counted.serve, "127.0.0.1", 0)
    return server, int(server.sockets[0].getsockname()[1])


async def _closed(engines: Engines, server: asyncio.Server, counted: RawEngine) -> None:
    """Close the client's connections, then the server once it saw them all end."""
    engines.close()
    await _until(lambda: counted.ended == counted.connections)
    server.close()
    await server.wait_closed()


async def _until(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not check():
        assert time.monotonic() < deadline, "it did not happen within 5 s"
        await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_a_request_goes_out_with_its_head_and_the_callers_headers() -> None:
    seen: list[httpx.Request] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"ok": True})

    async with engine_serving(engine) as port:
        engines = Engines()
        headers = {"X-Request-Id": "r1"}
        content_types: list[tuple[str, ...]] = [(), ("text/plain",)]  # the default, then one
        for given in content_types:
            answer = await engines.post("127.0.0.1", port, "/v1/x", b'{"a": 1}', headers, *given)
            assert json.loads(await answer.read(1 << 10)) == {"ok": True}
            answer.close()
        engines.close()
    assert [request.headers["content-type"] for request in seen] == [
        "application/json",
        "text/plain",
    ]
    for request in seen:
        assert (request.method, request.url.path, request.content) == ("POST", "/v1/x", b'{"a": 1}')
        assert request.headers["host"] == f"127.0.0.1:{port}"
        assert request.headers["content-length"] == "8"
        assert request.headers["x-request-id"] == "r1"


@pytest.mark.anyio
async def test_a_long_answer_read_slowly_arrives_whole_on_a_paused_connection() -> None:
    body = bytes(range(256)) * (3 * HIGH_WATER // 256)

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    async with engine_serving(lambda _: httpx.Response(200, content=chunks())) as port:
        engines = Engines()
        answer = await engines.post("127.0.0.1", port, "/v1/x", b"{}", {})
        # The engine sends far more than the high-water mark: reading pauses.
        await _until(lambda: answer._connection._paused)
        assert answer.status == 200
        assert answer.headers["transfer-encoding"] == "chunked"
        found = bytearray()
        while chunk := await answer.receive():
            found += chunk
            await asyncio.sleep(0)
        assert bytes(found) == body
        answer.close()
        engines.close()


@pytest.mark.anyio
async def test_a_connection_is_reused_while_fresh_and_not_once_idle_too_long() -> None:
    counted = _counted(b'{"ok": true}')
    server, port = await _serving(counted)
    engines = Engines(keepalive_s=0.3)
    try:
        for _ in range(3):
            answer = await engines.post("127.0.0.1", port, "/v1/x", b"{}", {"X-Id": "1"})
            assert await answer.read(1 << 10) == b'{"ok": true}'
            answer.close()
        assert counted.connections == 1
        await asyncio.sleep(0.4)  # past keepalive_s: the engine may be closing it
        answer = await engines.post("127.0.0.1", port, "/v1/x", b"{}", {})
        assert await answer.read(1 << 10) == b'{"ok": true}'
        answer.close()
        assert counted.connections == 2
    finally:
        await _closed(engines, server, counted)


@pytest.mark.anyio
async def test_an_answer_closed_before_its_end_closes_its_connection() -> None:
    counted = _counted(b"x" * (16 * HIGH_WATER))  # more than what arrives before it is read
    server, port = await _serving(counted)
    engines = Engines()
    try:
        answer = await engines.post("127.0.0.1", port, "/v1/x", b"{}", {})
        assert await answer.read(10) == b"x" * 10
        answer.close()  # a client left: the engine must see it at once
        await _until(lambda: counted.ended == 1)
        answer = await engines.post("127.0.0.1", port, "/v1/x", b"{}", {})
        assert len(await answer.read(1 << 30)) == 16 * HIGH_WATER
        answer.close()
        assert counted.connections == 2, "the abandoned connection was not reused"
    finally:
        await _closed(engines, server, counted)


@pytest.mark.anyio
async def test_an_engine_that_is_not_listening_is_named() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: refused
        with pytest.raises(
            EngineConnectionError, match=f"cannot connect to the engine at 127.0.0.1:{port}"
        ):
            await Engines().post("127.0.0.1", port, "/v1/x", b"{}", {})


@pytest.mark.anyio
async def test_an_engine_that_dies_mid_answer_or_talks_nonsense_fails_the_answer() -> None:
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\npartial")
        await writer.drain()
        writer.close()

    async def nonsense(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the router closes the connection
        writer.close()

    engines = Engines()
    for serve, says in ((dies, "closed the connection"), (nonsense, "is not HTTP")):
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            with pytest.raises(EngineConnectionError, match=says):
                await _read_whole(engines, port)
        finally:
            server.close()
            await server.wait_closed()


async def _read_whole(engines: Engines, port: int) -> bytes:
    answer = await engines.post("127.0.0.1", port, "/v1/x", b"{}", {})
    try:
        return await answer.read(1 << 20)
    finally:
        answer.close()


@pytest.mark.anyio
async def test_a_wait_for_the_body_ends_at_its_time() -> None:
    go = asyncio.Event()

    async def slow() -> AsyncIterator[bytes]:
        yield b"first"
        await go.wait()
        yield b"second"

    async with engine_serving(lambda _: httpx.Response(200, content=slow())) as port:
        engines = Engines()
        answer = await engines.post("127.0.0.1", port, "/v1/x", b"{}", {})
        assert await answer.receive(time.monotonic() + 5) == b"first"
        with pytest.raises(TimeoutError):
            await answer.receive(time.monotonic() + 0.1)
        go.set()
        assert await answer.receive(time.monotonic() + 5) == b"second"
        answer.close()
        engines.close()
