"""What the scheduler's ledger charges on each GPU, by phase, beside the GPU's capacity and
limits: one summary under one key, written by the scheduler when it changed and read by the
router's /metrics at each scrape."""

from __future__ import annotations

from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from capycommon.state import keys, quarantine

# What an instance is charged as: the ledger's phases, an LMCache server kept for a stopped
# instance (`cache`), and an engine no deployment owns (`orphan`, its whole GPU).
ChargePhase = Literal["starting", "ready", "parked", "waking", "cache", "orphan", "unknown"]


class GpuCharges(BaseModel):
    """One GPU of one host (a unified host's one pool is its GPU `unified`), in bytes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    host: str
    gpu: str
    capacity: int
    managed_limit: int
    reserve: int
    parked_limit: int
    # What admission may still take: the lower of the managed limit and the capacity less
    # the reserve, less every charge (none below zero).
    free: int
    charged: dict[ChargePhase, int]


class GpuMemory(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    gpus: tuple[GpuCharges, ...] = ()


async def publish(client: aioredis.Redis, summary: GpuMemory) -> None:
    await client.set(keys.gpu_memory(), summary.model_dump_json())


async def aread(client: aioredis.Redis) -> GpuMemory | None:
    """The last summary; None before the scheduler wrote one."""
    key = keys.gpu_memory()
    raw = await client.get(key)
    return None if raw is None else quarantine.parse(GpuMemory, raw, key)
