"""A joined host's keys as the control plane measures them (`capyctl_scheduler.hostquota`):
walked BATCH names at a time with SCAN, PACE_S apart, so a walk leaves Redis to serve
everyone else between its short commands."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import redis.asyncio as aioredis

from capycommon.state import keys

BATCH = 100
PACE_S = 0.005
SAMPLED = 1000


class HostKeyStore:
    """A joined host's keys, walked a batch at a time."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def names(self, host: str) -> AsyncIterator[list[bytes]]:
        """The host's keys, BATCH names at a time, PACE_S apart."""
        cursor = 0
        pattern = f"{keys.host_prefix(host)}:*"
        while True:
            cursor, names = cast(
                tuple[int, list[bytes]], await self.client.scan(cursor, match=pattern, count=BATCH)
            )
            if names:
                yield names
            if cursor == 0:
                return
            await asyncio.sleep(PACE_S)

    async def size(self, host: str, over: int | None = None) -> int:
        """The memory the host's keys take, by Redis's count; the walk stops once past
        `over`."""
        total = 0
        async for names in self.names(host):
            async with self.client.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.type(name)
                kinds = cast(list[bytes], await pipe.execute())
            async with self.client.pipeline(transaction=False) as pipe:
                for name, kind in zip(names, kinds, strict=True):
                    pipe.memory_usage(name, samples=SAMPLED if kind in {b"hash", b"set"} else 0)
                sizes = cast(list[int | None], await pipe.execute())
            total += sum(size or 0 for size in sizes)
            if over is not None and total > over:
                break
        return total

    async def drop(self, host: str) -> None:
        """Delete every key of the host (UNLINK: freed in Redis's background)."""
        async for names in self.names(host):
            await self.client.unlink(*names)
