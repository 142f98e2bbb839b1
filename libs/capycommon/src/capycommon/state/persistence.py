"""Whether Redis can save what it is given. While it cannot (most often its disk is full) it
refuses every write with MISCONF, and it takes writes again on its own once a save works."""

from __future__ import annotations

import redis.asyncio as aioredis


class Persistence:
    """Redis's own saving, as INFO tells it."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def save_failure(self) -> str | None:
        """Why Redis refuses writes now, or None while it saves."""
        info = await self.client.info("persistence")
        if info.get("aof_enabled") and info.get("aof_last_write_status") == "err":
            return "its last write to its append-only file failed"
        return None
