"""The management API's idempotency keys: the first request with a key claims it, its answer
is kept for a day, and a retry reads that answer back."""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.state import keys

TTL_S = 24 * 3600


class Answers:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def claim(self, key: str, claim: str) -> bool:
        """Take `key` with `claim` as its value; False when it was taken before."""
        return bool(await self.client.set(keys.idempotency(key), claim, nx=True, ex=TTL_S))

    async def get(self, key: str) -> bytes | str | None:
        return await self.client.get(keys.idempotency(key))

    async def keep(self, key: str, answer: str) -> None:
        await self.client.set(keys.idempotency(key), answer, ex=TTL_S)

    async def release(self, key: str) -> None:
        await self.client.delete(keys.idempotency(key))
