"""What the scheduler's ledger charges on each GPU, by phase, beside the GPU's capacity and
limits: one summary under one key, written by the scheduler when it changed and read by the
router's /metrics at each scrape."""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.memory import GpuMemory
from capycommon.state import keys, quarantine


async def publish(client: aioredis.Redis, summary: GpuMemory) -> None:
    await client.set(keys.gpu_memory(), summary.model_dump_json())


async def aread(client: aioredis.Redis) -> GpuMemory | None:
    """The last summary; None before the scheduler wrote one."""
    key = keys.gpu_memory()
    raw = await client.get(key)
    return None if raw is None else quarantine.parse(GpuMemory, raw, key)
