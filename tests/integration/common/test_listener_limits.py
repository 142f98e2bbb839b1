"""The inference listener on a real socket against connections that hold it: a request head
that never ends, a connection left idle, one client opening more connections than its bound."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest

from capycommon.credentials import generate
from capycommon.settings import ConnectionLimits
from capyctl_router.app import create_app
from integration.common.served import answer, closed_after, connected, request_head, served
from support import wait_for_async

APP = create_app(generate())


async def _health(port: int) -> int:
    async with connected(port) as (reader, writer):
        writer.write(request_head("GET", "/health"))
        return (await answer(reader))[0]


@pytest.mark.anyio
async def test_a_request_head_that_does_not_end_in_time_is_closed() -> None:
    limits = ConnectionLimits(header_timeout=0.5, keep_alive_timeout=30)
    async with served(APP, limits) as port, connected(port) as silent, connected(port) as slow:
        writer = slow[1]
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line

        async def dribble() -> None:  # a header line now and then, as slowloris does
            for n in range(20):
                await asyncio.sleep(0.1)
                writer.write(f"X-Slow-{n}: 1\r\n".encode())

        dribbling = asyncio.create_task(dribble())
        waited = await asyncio.gather(closed_after(silent[0]), closed_after(slow[0]))
        dribbling.cancel()
        assert all(seconds < 2 for seconds in waited), waited
        assert await _health(port) == 200, "a head that arrives in time is answered"
        async with connected(port) as (reader, writer):
            writer.write(request_head("GET", "/health"))
            assert (await answer(reader))[0] == 200
            writer.write(b"GET /health HTTP/1.1\r\n")  # the next request's, never ended
            assert await closed_after(reader) < 2, "closed long before the keep-alive timeout"


@pytest.mark.anyio
async def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout() -> None:
    limits = ConnectionLimits(header_timeout=0.2, keep_alive_timeout=1)
    async with served(APP, limits) as port, connected(port) as (reader, writer):
        for _ in range(2):  # kept alive between requests
            writer.write(request_head("GET", "/health"))
            assert (await answer(reader))[0] == 200
        waited = await closed_after(reader)
        assert 0.9 <= waited < 3, "the keep-alive timeout, not the header timeout, closed it"


@pytest.mark.anyio
async def test_connections_over_a_clients_bound_are_refused_while_others_are_served() -> None:
    limits = ConnectionLimits(header_timeout=30, connections_per_client=4)
    async with served(APP, limits) as port, contextlib.AsyncExitStack() as held:
        for _ in range(4):
            await held.enter_async_context(connected(port))
        async with connected(port) as (reader, writer):
            writer.write(request_head("GET", "/health"))
            status, body = await answer(reader)
            assert status == 503
            assert json.loads(body)["error"]["code"] == "unavailable"
            assert await closed_after(reader) < 1, "the refused connection is closed"
        other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(transport=other) as client:
            found = await client.get(f"http://127.0.0.1:{port}/health")
            assert found.status_code == 200, "another client is served"
        await held.aclose()
        await wait_for_async(
            lambda: _served(port), timeout=5, what="the client served once it closed some"
        )


async def _served(port: int) -> bool:
    return await _health(port) == 200
