"""What a host says of itself to the control plane: the host settings that decide how its
deployments resolve. hostd writes it under the host's prefix when it starts, before it
publishes its engines; the scheduler reads it with each snapshot."""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.hosts import HostInfo
from capycommon.domain.notifications import Notification
from capycommon.state import keys, quarantine


async def publish(client: aioredis.Redis, host: str, info: HostInfo) -> None:
    await client.set(keys.host_info(host), info.model_dump_json())
    note = Notification(kind="host", id=host, version=0)
    await client.publish(keys.host_notifications(host), note.model_dump_json())


async def aread(client: aioredis.Redis, host: str) -> HostInfo | None:
    """The host's info; None before its hostd first started."""
    key = keys.host_info(host)
    raw = await client.get(key)
    return None if raw is None else quarantine.parse(HostInfo, raw, key)


async def join(client: aioredis.Redis, host: str) -> None:
    """Count `host` among the hosts the control plane plans for and routes to."""
    await client.sadd(keys.hosts(), host)


async def hosts(client: aioredis.Redis) -> set[str]:
    """The hosts that joined."""
    return {_text(host) for host in await client.smembers(keys.hosts())}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
