"""Aborted requests an engine has ended, as hostd proves it, so the router can give back
each one's place at once instead of waiting for the engine to read idle.

hostd appends one `RequestEnd` to the stream `keys.request_ends(host)` when an engine it
asked to abort a request shows that it no longer holds that request. `held` says whether
the engine held the request when it was aborted: only then is it proven that a request cut
before any answer had reached the engine (one that never reached it may still arrive, so
only a stop settles it). The router reads the stream after a cursor it takes before sending
the abort, so no end it waits for is missed.
"""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis

from capycommon.domain.hosts import RequestEnd
from capycommon.state import keys, quarantine

FIELD = "end"
# About this many ends are kept per host; the router reads them within a second.
KEEP = 10_000

Entries = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


class SettlementStore:
    """Each host's stream of proven request ends."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def publish(self, host: str, end: RequestEnd) -> None:
        await self.client.xadd(
            keys.request_ends(host), {FIELD: end.model_dump_json()}, maxlen=KEEP, approximate=True
        )

    async def cursor(self, host: str) -> str:
        """The id of the host's latest end (ends after it are new), or "0-0"."""
        latest = cast(
            list[tuple[bytes, object]],
            await self.client.xrevrange(keys.request_ends(host), count=1),
        )
        return latest[0][0].decode() if latest else "0-0"

    async def read_after(
        self, host: str, after: str, count: int = 500
    ) -> tuple[str, list[RequestEnd]]:
        """The host's ends after the cursor `after`, and the cursor past them."""
        key = keys.request_ends(host)
        read = cast(Entries, await self.client.xread({key: after}, count=count))
        if not read:
            return after, []
        entries = read[0][1]
        found = (quarantine.parse_entry(RequestEnd, fields, FIELD, key) for _, fields in entries)
        return entries[-1][0].decode(), [end for end in found if end is not None]
