"""A listener on a real socket against a request body sent a byte at a time to a route that
answers without reading it (here, a method the route does not take): the answer goes out,
then the connection is closed, not held for as long as the client sends; a body that all
came leaves its connection kept alive for the next request."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from capycommon.credentials import generate
from capycommon.settings import ConnectionLimits
from capyctl_router.app import create_app
from integration.common.served import answer, closed_after, connected, request_head, served

APP = create_app(generate())
# Well under the keep-alive timeout: the connection ends with its answer.
CLOSED_WITHIN_S = 5.0


async def _trickle(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        for _ in range(1000):
            writer.write(b" ")
            await writer.drain()
            await asyncio.sleep(0.1)  # the client's pace, not a wait for a condition


@pytest.mark.anyio
async def test_an_answer_before_the_body_ended_closes_the_connection() -> None:
    limits = ConnectionLimits(keep_alive_timeout=30)
    async with served(APP, limits) as port, connected(port) as (reader, writer):
        writer.write(request_head("PUT", "/health", Content_Length="1000"))
        sending = asyncio.create_task(_trickle(writer))
        try:
            async with asyncio.timeout(30):
                head = await reader.readuntil(b"\r\n\r\n")
                closed = await closed_after(reader)
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    assert head.split(b" ", 2)[1] == b"405"
    # Said in the answer, so a client never sends its next request on it.
    assert b"\r\nconnection: close\r\n" in head.lower()
    assert closed < CLOSED_WITHIN_S, closed


@pytest.mark.anyio
async def test_an_answer_after_the_whole_body_keeps_the_connection() -> None:
    limits = ConnectionLimits(keep_alive_timeout=30)
    async with served(APP, limits) as port, connected(port) as (reader, writer):
        writer.write(request_head("PUT", "/health", Content_Length="4") + b"body")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.split(b" ", 2)[1] == b"405"
        assert b"connection: close" not in head.lower()
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        writer.write(request_head("GET", "/health"))
        assert (await answer(reader))[0] == 200, "the same connection serves the next request"
