"""Publishing a host's engine registry to Redis: the key, then a notification."""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.notifications import Notification
from capycommon.engines.registry import PublishedEngines, Registry
from capycommon.state import keys, quarantine


def _payload(registry: Registry) -> tuple[str, str]:
    published = PublishedEngines(
        revision=registry.revision,
        source=str(registry.path),
        profiles=sorted(registry.document.profiles.values(), key=lambda p: p.name),
    )
    note = Notification(kind="engines", id="registry", version=registry.revision)
    return published.model_dump_json(), note.model_dump_json()


class EngineFactsStore:
    """Each host's published engine registry."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def publish(self, host: str, registry: Registry) -> None:
        value, note = _payload(registry)
        await self.client.set(keys.engines(host), value)
        await self.client.publish(keys.host_notifications(host), note)

    async def get(self, host: str) -> PublishedEngines | None:
        """The host's published engines; None before its hostd first published them."""
        key = keys.engines(host)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(PublishedEngines, raw, key)
