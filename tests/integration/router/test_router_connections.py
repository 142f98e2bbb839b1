"""The router served on a real socket, with a real redis-server behind a small pool: many
more concurrent requests than places, queue and Redis connections end in 200 or 429 queue_full
(never a 500) and leave no place taken; the spare place a run of requests leaves goes back
the moment its instance drains; a client that leaves mid-body or mid-stream is one log line,
no traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from capycommon.credentials import generate
from capycommon.domain.instances import InstanceState
from capycommon.domain.notifications import Notification
from capycommon.engineclient import Engines
from capycommon.service import redis_client
from capycommon.settings import ConnectionLimits
from capycommon.state import keys, notify, places
from capycommon.state.stores import State
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table
from integration.common.served import chat_head, connected, served
from integration.router.fakeengine import engine_serving
from integration.router.ready import put_ready
from support import wait_for_async

CREDENTIALS = generate()
HOST = "local"
NAME = "m"
AUTH = {"Authorization": f"Bearer {CREDENTIALS.api_key}"}
CHAT = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "stream": True}
# Fewer Redis connections than the router's places and queue together.
POOL = 8


def _event(content: str) -> bytes:
    chunk = {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


@dataclass
class Engine:
    """A streaming engine that holds every answer after its first event until `go` is set."""

    go: asyncio.Event = field(default_factory=asyncio.Event)
    entered: int = 0

    async def answer(self, _: httpx.Request) -> httpx.Response:
        self.entered += 1
        if self.entered >= places.LIMIT:  # every place is taken: the rest queue
            self.go.set()
        return httpx.Response(
            200, content=self._events(), headers={"content-type": "text/event-stream"}
        )

    async def _events(self) -> AsyncIterator[bytes]:
        yield _event("hello")
        await self.go.wait()
        yield _event(" there")
        yield b"data: [DONE]\n\n"


@dataclass
class Stand:
    state: State
    dispatcher: Dispatcher
    port: int
    engine: Engine

    def gauge(self, name: str) -> float | None:
        return self.dispatcher.metrics.registry.get_sample_value(name, {"deployment": NAME})

    async def running(self) -> int:
        return (await self.state.places.get(NAME)).running


@pytest.fixture
async def stand(redis_socket: Path) -> AsyncIterator[Stand]:
    """The router as its service runs it (the routing table followed, cut requests settled),
    on a Redis pool of POOL connections, in front of one `Engine`."""
    state = State(redis_client(f"unix://{redis_socket}", connections=POOL))
    engine = Engine()
    async with engine_serving(engine.answer) as engine_port:
        await put_ready(state.client, NAME, host=HOST, port=engine_port)
        table = Table(state, {HOST})
        await table.sync()
        dispatcher = Dispatcher(state, table, Metrics())
        engines = Engines()
        app = create_app(CREDENTIALS, Router(dispatcher, engines))
        stop = asyncio.Event()
        background = [
            asyncio.create_task(table.run(stop)),
            asyncio.create_task(dispatcher.settle(stop)),
        ]
        try:
            async with served(app, ConnectionLimits(connections_per_client=1000)) as port:
                yield Stand(state, dispatcher, port, engine)
        finally:
            stop.set()
            await asyncio.gather(*background)
            engines.close()
            await state.client.aclose()


@pytest.mark.anyio
async def test_many_more_requests_than_places_queue_or_are_refused_never_fail(
    stand: Stand, caplog: pytest.LogCaptureFixture
) -> None:
    async def one(client: httpx.AsyncClient) -> tuple[int, bytes]:
        async with client.stream("POST", "/v1/chat/completions", json=CHAT, headers=AUTH) as r:
            return r.status_code, await r.aread()

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    base = f"http://127.0.0.1:{stand.port}"
    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=60) as client:
        answers = await asyncio.gather(*(one(client) for _ in range(300)))
    assert {status for status, _ in answers} == {200, 429}, "answered or queue_full, never 500"
    assert all(body.endswith(b"data: [DONE]\n\n") for status, body in answers if status == 200)
    await wait_for_async(lambda: _zero(stand), timeout=10, what="every place given back")
    assert stand.gauge("capyctl_requests_running") == 0
    assert stand.gauge("capyctl_requests_waiting") == 0
    _no_traceback(caplog)


async def _zero(stand: Stand) -> bool:
    return await stand.running() == 0


@pytest.mark.anyio
async def test_a_spare_place_goes_back_the_moment_its_instance_drains(
    stand: Stand, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(places, "SPARE_IDLE_S", 600.0)  # not given back for being unused
    stand.engine.go.set()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{stand.port}", timeout=30) as http:
        for _ in range(3):
            answer = await http.post("/v1/chat/completions", json=CHAT, headers=AUTH)
            assert answer.status_code == 200
    found = await stand.state.places.get(NAME)
    assert (found.running, found.spare) == (0, 1), "its place kept for the next request"
    store = stand.state.instances(HOST)
    ready = await store.get(NAME, 0)
    assert ready is not None
    draining = ready.model_copy(update={"state": InstanceState.DRAINING, "since": time.time()})
    async with notify.subscribed(stand.state.client, [keys.notifications()]) as pubsub:
        await store.transition(draining, allowed=[InstanceState.READY], generation=1, reason="t")
        await wait_for_async(lambda: _no_spare(stand), timeout=5, what="the spare given back")
        assert stand.dispatcher.book.held == {}
        # The scheduler, whose drain waits for it, is told.
        async with asyncio.timeout(5):
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
                if message is not None:
                    note = Notification.model_validate_json(message["data"])
                    if (note.kind, note.id) == ("places", NAME):
                        break


async def _no_spare(stand: Stand) -> bool:
    return (await stand.state.places.get(NAME)).spare == 0


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if text in record.getMessage()]


def _no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert not [record for record in caplog.records if record.exc_info], "no traceback"
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


@pytest.mark.anyio
async def test_a_client_that_leaves_mid_body_is_one_line(
    stand: Stand, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with connected(stand.port) as (_, writer):
        writer.write(chat_head(CREDENTIALS.api_key, 1000) + b'{"model": "m", ')
        await writer.drain()

    async def logged() -> bool:
        return bool(_lines(caplog, "left while sending its request"))

    await wait_for_async(logged, timeout=10, what="the line saying the client left")
    (line,) = _lines(caplog, "left")
    assert line.getMessage().endswith("POST /v1/chat/completions")
    _no_traceback(caplog)


@pytest.mark.anyio
async def test_a_client_that_leaves_mid_stream_is_one_line(
    stand: Stand, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    body = json.dumps(CHAT).encode()
    async with connected(stand.port) as (reader, writer):
        writer.write(chat_head(CREDENTIALS.api_key, len(body)) + body)
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        assert head.startswith("HTTP/1.1 200")
        assert b"hello" in await reader.readuntil(b"\n\n"), "the first event, then silence"
    request_id = head.partition("x-capyctl-request-id: ")[2].split("\r\n")[0]

    async def cut() -> bool:
        return bool(_lines(caplog, f"request {request_id} on {NAME} cut"))

    await wait_for_async(cut, timeout=10, what="the line saying the request was cut")
    assert len(_lines(caplog, request_id)) == 1
    assert not _lines(caplog, "left while sending"), "its body had all come"
    _no_traceback(caplog)
