"""Publishing a host's engine registry to Redis: the key, then a notification."""

from __future__ import annotations

import redis
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


async def publish(client: aioredis.Redis, host: str, registry: Registry) -> None:
    value, note = _payload(registry)
    await client.set(keys.engines(host), value)
    await client.publish(keys.host_notifications(host), note)


def publish_sync(client: redis.Redis, host: str, registry: Registry) -> None:
    value, note = _payload(registry)
    client.set(keys.engines(host), value)
    client.publish(keys.host_notifications(host), note)


def read_published(client: redis.Redis, host: str) -> PublishedEngines | None:
    key = keys.engines(host)
    raw = client.get(key)
    return None if raw is None else quarantine.parse(PublishedEngines, raw, key)


async def aread_published(client: aioredis.Redis, host: str) -> PublishedEngines | None:
    """The host's published engines; None before its hostd first published them."""
    key = keys.engines(host)
    raw = await client.get(key)
    return None if raw is None else quarantine.parse(PublishedEngines, raw, key)
