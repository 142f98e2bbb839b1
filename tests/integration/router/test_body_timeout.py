"""A request body trickled a byte at a time, each within the idle bound a body may pause, to
the router served on a real socket (a real redis-server, one ready deployment): answered
408 request_timeout in the OpenAI envelope once the listener's body bound has passed, and
its connection closed; nothing reached the engine and no place was taken."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from capycommon.credentials import generate
from capycommon.engineclient import Engines
from capycommon.settings import ConnectionLimits
from capycommon.state.stores import State
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table
from integration.common.served import (
    answer,
    chat_head,
    closed_after,
    connected,
    served,
)
from integration.router.fakeengine import engine_serving
from integration.router.ready import put_ready

CREDENTIALS = generate()
HOST = "local"
NAME = "m"
# The bound the test sets: short, so the test is quick.
BOUND_S = 1.0
# A byte this often: well within the 5 s a body may pause.
EVERY_S = 0.1
CHAT = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "hi"}]}).encode()


@dataclass
class Stand:
    state: State
    port: int
    sent: list[bytes] = field(default_factory=list)

    def engine(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request.content)
        return httpx.Response(200, json={"choices": [], "usage": None})


@pytest.fixture
async def stand(redis_socket: Path) -> AsyncIterator[Stand]:
    """The router with the listener's body bound at BOUND_S, as its worker builds it, in
    front of one ready deployment."""
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    stand = Stand(state, 0)
    limits = ConnectionLimits(body_timeout=BOUND_S)
    engines = Engines()
    async with engine_serving(stand.engine) as engine_port:
        await put_ready(state.client, NAME, host=HOST, port=engine_port)
        table = Table(state, {HOST})
        await table.sync()
        router = Router(Dispatcher(state, table, Metrics()), engines, limits.body_timeout)
        async with served(create_app(CREDENTIALS, router), limits) as port:
            stand.port = port
            yield stand
    engines.close()
    await state.client.aclose()


async def _trickle(writer: asyncio.StreamWriter, body: bytes) -> None:
    """`body` a byte every EVERY_S, until it is sent or the server closes the connection."""
    with contextlib.suppress(ConnectionError):
        for byte in body:
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(EVERY_S)  # the client's pace, not a wait for a condition


@pytest.mark.anyio
async def test_a_trickled_body_is_a_408_and_its_connection_closes(stand: Stand) -> None:
    # A body that would take 100 s at this pace (1,000 bytes).
    body = CHAT + b" " * (1000 - len(CHAT))
    head = chat_head(CREDENTIALS.api_key, len(body))
    loop = asyncio.get_running_loop()
    async with connected(stand.port) as (reader, writer):
        writer.write(head)
        started = loop.time()
        sending = asyncio.create_task(_trickle(writer, body))
        try:
            async with asyncio.timeout(30):
                status, text = await answer(reader)
                took = loop.time() - started
                closed = await closed_after(reader)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    assert status == 408
    error = json.loads(text)["error"]
    assert (error["code"], error["type"]) == ("request_timeout", "invalid_request_error")
    assert f"longer than {BOUND_S:g} s" in error["message"]
    assert "of the 1000 its Content-Length announced" in error["message"]
    assert BOUND_S <= took < 10 * BOUND_S, took
    assert closed < 5, "the connection is closed with the answer, whatever the client sends"
    assert stand.sent == [], "nothing reached the engine"
    assert (await stand.state.places.get(NAME)).running == 0


@pytest.mark.anyio
async def test_a_body_sent_within_the_bound_is_served(stand: Stand) -> None:
    """A body in parts, each pause within the idle bound, the whole within the body bound."""

    async def parts() -> AsyncIterator[bytes]:
        for at in range(0, len(CHAT), len(CHAT) // 3 + 1):
            yield CHAT[at : at + len(CHAT) // 3 + 1]
            await asyncio.sleep(EVERY_S)  # the client's pace

    headers = {"Authorization": f"Bearer {CREDENTIALS.api_key}", "Content-Length": str(len(CHAT))}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{stand.port}", timeout=30) as http:
        done = await http.post("/v1/chat/completions", content=parts(), headers=headers)
    assert done.status_code == 200, done.text
    (forwarded,) = stand.sent
    assert json.loads(forwarded)["messages"] == json.loads(CHAT)["messages"]
