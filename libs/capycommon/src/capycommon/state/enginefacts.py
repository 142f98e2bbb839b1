"""Publishing a host's engine registry to Redis: the key, then a notification."""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.notifications import Notification
from capycommon.engines.registry import PublishedEngines, Registry
from capycommon.state import keys
from capycommon.state.hostrecord import HostRecordStore


class EngineFactsStore(HostRecordStore[PublishedEngines]):
    """Each host's published engine registry."""

    def __init__(self, client: aioredis.Redis) -> None:
        super().__init__(client, keys.engines, PublishedEngines)

    async def publish(self, host: str, registry: Registry) -> None:
        published = PublishedEngines(
            revision=registry.revision,
            source=str(registry.path),
            profiles=sorted(registry.document.profiles.values(), key=lambda p: p.name),
        )
        note = Notification(kind="engines", id="registry", version=registry.revision)
        await self._put(host, published, note)
