"""The status page's sessions, the management app in process over a real redis-server: a
logout ends its session on the server, so its cookie replayed opens nothing and its open
stream of updates ends, while another session stays open; Redis holds no session's id."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI
from starlette.types import Message

from capycommon.credentials import generate
from capycommon.state.stores import State
from capyctl_scheduler.app import create_app
from capyctl_scheduler.loop import Scheduler
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.observe import Observer
from capyctl_scheduler.page import session

CREDENTIALS = generate()
HOST = "local"
BASE = "http://scheduler"


@pytest.fixture
async def state(redis_socket: Path) -> AsyncIterator[State]:
    found = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    yield found
    await found.client.aclose()


@pytest.fixture
def app(state: State) -> FastAPI:
    return create_app(CREDENTIALS, Manager(Scheduler(state, Observer(state, [HOST]))))


@contextlib.asynccontextmanager
async def browser(app: FastAPI, cookie: str | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """A client of the app with its own cookies (`cookie`: a session's, replayed)."""
    cookies = {session.COOKIE: cookie} if cookie is not None else None
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE, cookies=cookies) as http:
        yield http


async def logged_in(http: httpx.AsyncClient) -> str:
    """Log `http` in with the admin token; its session's id."""
    answer = await http.post("/login", data={"token": CREDENTIALS.admin_token})
    assert answer.status_code == 303, answer.text
    opened = http.cookies[session.COOKIE]
    assert (await http.get("/")).status_code == 200
    return opened


async def refused(app: FastAPI, cookie: str) -> None:
    """Every part of the page refuses `cookie`: the login form, or 401 for scripts."""
    async with browser(app, cookie) as http:
        page = await http.get("/")
        assert page.status_code == 401
        assert 'action="/login"' in page.text
        assert (await http.get("/events")).status_code == 401
        assert (await http.get("/confirm?target=host&name=local&action=drain")).status_code == 401
        act = await http.post(
            "/actions",
            data={"target": "host", "name": "local", "action": "drain", "key": "k"},
            headers={"Accept": "application/json"},
        )
        assert act.status_code == 401
        assert act.json()["error"]["code"] == "unauthenticated"


@pytest.mark.anyio
async def test_a_logout_ends_its_session_and_no_other(app: FastAPI, state: State) -> None:
    async with browser(app) as one, browser(app) as two:
        first, second = await logged_in(one), await logged_in(two)
        assert first != second
        stored = [key.decode() async for key in state.client.scan_iter("capyctl:page-session:*")]
        assert len(stored) == 2
        assert not any(first in key or second in key for key in stored), "ids stay in cookies"
        ttl = await state.client.ttl(stored[0])
        assert session.LIFETIME_S - 60 < ttl <= session.LIFETIME_S
        assert (await one.post("/logout")).status_code == 303
        assert session.COOKIE not in one.cookies
        await refused(app, first)
        # The other login is untouched.
        assert (await two.get("/")).status_code == 200
        async with browser(app, second) as copy:
            assert (await copy.get("/")).status_code == 200
    sessions = state.page_sessions
    mark = session.mark(CREDENTIALS.admin_token)
    assert not await sessions.is_open(first, mark)
    assert await sessions.is_open(second, mark)
    # Opened under another admin token: no session of this one.
    assert not await sessions.is_open(second, session.mark(generate().admin_token))


@pytest.mark.anyio
async def test_a_logout_ends_the_open_stream_of_its_session(app: FastAPI) -> None:
    async with browser(app) as http:
        opened = await logged_in(http)
        async with streaming(app, "/events", opened) as chunks:
            first = await asyncio.wait_for(chunks.get(), 30)
            assert first is not None
            assert first.startswith(b"retry:")
            assert await _until(chunks, b"event: section") is not None
            assert (await http.post("/logout")).status_code == 303
            ending = await _until(chunks, b"event: ended")
            assert ending is not None, "the stream ended without saying why"
            assert await asyncio.wait_for(chunks.get(), 30) is None, "it ends there"


async def _until(chunks: asyncio.Queue[bytes | None], wanted: bytes) -> bytes | None:
    """The first chunk holding `wanted` (None: the stream ended first), within 30 s."""
    async with asyncio.timeout(30):
        while (chunk := await chunks.get()) is not None:
            if wanted in chunk:
                return chunk
    return None


@contextlib.asynccontextmanager
async def streaming(
    app: FastAPI, path: str, cookie: str
) -> AsyncIterator[asyncio.Queue[bytes | None]]:
    """A GET of `path` with the session's cookie, straight through ASGI: each chunk of its
    200 answer's body as it is sent, None when it ends."""
    chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
    gone = asyncio.Event()
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"scheduler"), (b"cookie", f"{session.COOKIE}={cookie}".encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("scheduler", 80),
    }
    asked = False

    async def receive() -> Message:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        elif message["type"] == "http.response.body":
            if message.get("body"):
                chunks.put_nowait(message["body"])
            if not message.get("more_body", False):
                chunks.put_nowait(None)

    task = asyncio.create_task(app(scope, receive, send))
    try:
        yield chunks
    finally:
        gone.set()
        async with asyncio.timeout(30):
            await task
