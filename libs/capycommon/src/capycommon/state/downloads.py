"""Model downloads on a host, as `capyctl status deployment` and `capyctl model pull` show
them.

hostd writes one `Download` record per deployment whose launch is downloading its model from
the Hub, a few times a second while bytes arrive, and deletes it when the download ends (the
store is complete, or the launch failed and says why). A pull or removal that an operator
asked for (`commands.Pull`, `Remove`) has a `StoreOperation` record instead, which
outlives its end by `DONE_TTL_S`, so the CLI that asked reads how it ended.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.hosts import Download, StoreOperation
from capycommon.state import keys, quarantine

# A record hostd stopped refreshing (hostd gone mid-download) expires on its own.
TTL_S = 60
# How long the end of a store operation stays to be read.
DONE_TTL_S = 3600


class DownloadStore:
    """Each host's download records and store operations."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def write(self, host: str, deployment: str, download: Download) -> None:
        key = keys.host_download(host, deployment)
        await self.client.set(key, download.model_dump_json(), ex=TTL_S)

    async def clear(self, host: str, deployment: str) -> None:
        await self.client.delete(keys.host_download(host, deployment))

    async def get(self, host: str, deployment: str) -> Download | None:
        key = keys.host_download(host, deployment)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(Download, raw, key)

    async def write_operation(self, host: str, operation: str, record: StoreOperation) -> None:
        ttl = TTL_S if record.state == "running" else DONE_TTL_S
        key = keys.host_store_operation(host, operation)
        await self.client.set(key, record.model_dump_json(), ex=ttl)

    async def operation(self, host: str, operation: str) -> StoreOperation | None:
        key = keys.host_store_operation(host, operation)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(StoreOperation, raw, key)
