"""A router whose Redis stays away: a request tries again for 2 s at most, then gets 503
redis_unreachable with Retry-After, in the OpenAI envelope; never a 500."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import pytest

from capycommon.credentials import generate
from capycommon.engineclient import Engines
from capycommon.service import redis_client
from capycommon.state.stores import State
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import REDIS_RETRY_S, Dispatcher
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table
from integration.router.ready import put_ready
from support import short_dir

CREDENTIALS = generate()
HOST = "local"
NAME = "m"


@pytest.mark.anyio
async def test_a_request_gets_a_503_to_retry_within_2_s(redis_socket: Path) -> None:
    live = State(redis_client(f"unix://{redis_socket}"))
    nowhere = short_dir("gone")
    gone = State(redis_client(f"unix://{nowhere / 'redis.sock'}"))
    await put_ready(live.client, NAME, host=HOST)
    table = Table(live, {HOST})
    await table.sync()  # the table was read before Redis went away
    app = create_app(CREDENTIALS, Router(Dispatcher(gone, table, Metrics()), Engines()))
    body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {CREDENTIALS.api_key}"}
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            started = time.monotonic()
            answer = await http.post("/v1/chat/completions", json=body, headers=headers)
            took = time.monotonic() - started
    finally:
        await live.client.aclose()
        await gone.client.aclose()
        shutil.rmtree(nowhere)
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "1"
    assert answer.json()["error"]["code"] == "redis_unreachable"
    assert REDIS_RETRY_S <= took < REDIS_RETRY_S + 1, "it tried again for 2 s, no longer"
