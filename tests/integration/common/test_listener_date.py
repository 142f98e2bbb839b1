"""A quiet listener does not tick: with no connection open, uvicorn's once-a-second refresh of
the Date header waits, and a connection that opens refreshes it before its first answer."""

from __future__ import annotations

import asyncio
import time
from email.utils import parsedate_to_datetime
from typing import Any

import pytest

from capycommon.settings import ConnectionLimits
from integration.common.served import connected, request_head, served


async def _ok(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


async def _date(port: int) -> float:
    """The Date header of one answer on a new connection, as a Unix time."""
    async with connected(port) as (reader, writer):
        writer.write(request_head("GET", "/", Connection="close"))
        head = await reader.readuntil(b"\r\n\r\n")
        assert await reader.read() == b"ok"
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"date":
            return parsedate_to_datetime(value.strip().decode()).timestamp()
    raise AssertionError(f"no Date header in {head!r}")


@pytest.mark.anyio
async def test_a_connection_after_a_quiet_spell_gets_the_current_date() -> None:
    async with served(_ok, ConnectionLimits()) as port:
        await _date(port)
        await asyncio.sleep(3.2)  # no connection open: the tick waits
        # The header has a resolution of a second: within 1 s of now (and not 3 s old).
        assert abs(await _date(port) - time.time()) < 1.5
