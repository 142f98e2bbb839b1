"""A model download under way on a host, as `capyctl status deployment` shows it.

hostd writes one record per deployment whose launch is downloading its model from the Hub,
a few times a second while bytes arrive, and deletes it when the download ends (the store is
complete, or the launch failed and says why).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from capycommon.state import keys

# A record hostd stopped refreshing (hostd gone mid-download) expires on its own.
TTL_S = 60


class Download(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    repo: str
    commit: str
    done_bytes: int
    total_bytes: int
    # Bytes a second over the download so far.
    rate: float
    started_at: float
    at: float


async def write(client: aioredis.Redis, host: str, deployment: str, download: Download) -> None:
    await client.set(keys.host_download(host, deployment), download.model_dump_json(), ex=TTL_S)


async def clear(client: aioredis.Redis, host: str, deployment: str) -> None:
    await client.delete(keys.host_download(host, deployment))


async def aread(client: aioredis.Redis, host: str, deployment: str) -> Download | None:
    raw = await client.get(keys.host_download(host, deployment))
    return None if raw is None else Download.model_validate_json(raw)
