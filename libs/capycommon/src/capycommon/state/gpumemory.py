"""What the scheduler's ledger charges on each GPU, by phase, beside the GPU's capacity and
limits: one summary under one key, written by the scheduler when it changed and read by the
router's /metrics at each scrape."""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.memory import GpuMemory
from capycommon.state import keys, quarantine


class GpuMemoryStore:
    """The scheduler's summary of each GPU's charges."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def publish(self, summary: GpuMemory) -> None:
        await self.client.set(keys.gpu_memory(), summary.model_dump_json())

    async def get(self) -> GpuMemory | None:
        """The last summary; None before the scheduler wrote one."""
        key = keys.gpu_memory()
        return quarantine.parse(GpuMemory, await self.client.get(key), key)
