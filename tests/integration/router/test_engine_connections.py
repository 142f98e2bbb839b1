"""The router keeps its connections to an engine open across requests: an answer read to its
`[DONE]` gives the connection back to the pool, so a request costs no new TCP connection (and
the engine no accept) however many come. The engine here is a real HTTP/1.1 server on a
loopback socket that counts the connections it is given."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from capycommon.credentials import generate
from capycommon.engineclient import Engines
from capycommon.settings import ConnectionLimits
from capycommon.state.stores import State
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table
from integration.common.served import chat_head, connected, served
from integration.router.fakeengine import RawEngine, engine_serving
from integration.router.ready import chunk, put_ready
from support import wait_for_async

CREDENTIALS = generate()
HI: list[Any] = [{"role": "user", "content": "hi"}]


def _chunk(content: str, finish: str | None = None) -> bytes:
    """The event as one HTTP/1.1 chunk."""
    data = chunk(content, finish).encode()
    return b"%x\r\n%s\r\n" % (len(data), data)


def _engine() -> RawEngine:
    """Answers every request with a short SSE stream in chunks, keeping the connection."""
    done = b"data: [DONE]\n\n"
    return RawEngine(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
        + _chunk("hello")
        + _chunk("", "stop")
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done)
    )


async def _app(state: State, port: int, engines: Engines) -> FastAPI:
    """The router's app in front of the engine on `port`, serving deployment `m`."""
    await put_ready(state.client, "m", port=port)
    table = Table(state, {"local"})
    await table.sync()
    return create_app(CREDENTIALS, Router(Dispatcher(state, table, Metrics()), engines))


@pytest.fixture
async def routed(redis_socket: Path) -> AsyncIterator[tuple[RawEngine, openai.AsyncOpenAI]]:
    engine = _engine()
    server = await asyncio.start_server(engine.serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    engines = Engines()
    app = await _app(state, port, engines)
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router")
    sdk = openai.AsyncOpenAI(
        base_url="http://router/v1", api_key=CREDENTIALS.api_key, http_client=http, max_retries=0
    )
    try:
        yield engine, sdk
        assert (await state.places.get("m")).running == 0
    finally:
        await sdk.close()
        engines.close()
        await state.client.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.anyio
async def test_requests_one_after_another_share_one_engine_connection(
    routed: tuple[RawEngine, openai.AsyncOpenAI],
) -> None:
    engine, sdk = routed
    for _ in range(5):
        answer = await sdk.chat.completions.create(model="m", messages=HI)
        assert answer.choices[0].message.content == "hello"
        chunks = await sdk.chat.completions.create(model="m", messages=HI, stream=True)
        assert [c.choices[0].delta.content async for c in chunks if c.choices] == ["hello", ""]
    assert engine.requests == 10
    assert engine.connections == 1


@pytest.mark.anyio
async def test_each_event_reaches_the_client_before_the_engine_sends_the_next(
    redis_socket: Path,
) -> None:
    """The router sends the events it has at once: the engine sends its second event only
    once the client got the first, through the router's real listener."""
    seen = asyncio.Event()

    async def paced() -> AsyncIterator[bytes]:
        yield chunk("one").encode()
        await seen.wait()
        yield chunk("two", "stop").encode() + b"data: [DONE]\n\n"

    headers = {"content-type": "text/event-stream"}
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    engines = Engines()
    async with engine_serving(
        lambda _: httpx.Response(200, content=paced(), headers=headers)
    ) as port:
        app = await _app(state, port, engines)
        async with served(app, ConnectionLimits()) as router_port:
            http = httpx2.AsyncClient(timeout=10)
            sdk = openai.AsyncOpenAI(
                base_url=f"http://127.0.0.1:{router_port}/v1",
                api_key=CREDENTIALS.api_key,
                http_client=http,
                max_retries=0,
            )
            words = []
            async with asyncio.timeout(10):
                async for part in await sdk.chat.completions.create(
                    model="m", messages=HI, stream=True
                ):
                    words.append(part.choices[0].delta.content)
                    seen.set()
            await sdk.close()
    engines.close()
    await state.client.aclose()
    assert words == ["one", "two"]


@pytest.mark.anyio
async def test_a_request_cut_before_it_was_sent_gives_its_place_back_at_once(
    redis_socket: Path,
) -> None:
    """The engine's listener takes no more connections (its queue is full), so the router
    is still connecting when the client hangs up: the engine never got the request, and its
    place comes back at once instead of waiting for the instance's stop."""
    engine = socket.socket()
    engine.bind(("127.0.0.1", 0))
    engine.listen(0)
    port = engine.getsockname()[1]
    fillers = []
    for _ in range(2):  # the accept queue, full: a new SYN goes unanswered
        filler = socket.socket()
        filler.setblocking(False)
        filler.connect_ex(("127.0.0.1", port))
        fillers.append(filler)
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    engines = Engines()
    app = await _app(state, port, engines)
    body = json.dumps({"model": "m", "messages": HI}).encode()
    head = chat_head(CREDENTIALS.api_key, len(body))
    try:
        async with served(app, ConnectionLimits()) as router_port:
            async with connected(router_port) as (_, writer):
                writer.write(head + body)
                await writer.drain()
                await wait_for_async(
                    lambda: _running(state), timeout=10, what="the request to take its place"
                )
                await wait_for_async(
                    lambda: _connecting(port), timeout=10, what="the router to connect"
                )
            await wait_for_async(lambda: _given_back(state), timeout=5, what="the place given back")
    finally:
        engines.close()
        await state.client.aclose()
        for filler in fillers:
            filler.close()
        engine.close()


async def _connecting(port: int) -> bool:
    """Whether a connection to 127.0.0.1:`port` waits for the answer to its SYN."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(f"0100007F:{port:04X}" == row.split()[2] and row.split()[3] == "02" for row in rows)


async def _running(state: State) -> bool:
    return (await state.places.get("m")).running == 1


async def _given_back(state: State) -> bool:
    found = await state.places.get("m")
    return (found.running, found.settle_at_stop) == (0, 0)
