"""What a host says of itself to the control plane: the host settings that decide how its
deployments resolve. hostd writes it under the host's prefix when it starts, before it
publishes its engines; the scheduler reads it with each snapshot."""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.hosts import HostInfo
from capycommon.domain.notifications import Notification
from capycommon.state import keys, quarantine


class HostInfoStore:
    """What each host says of itself, and which hosts joined."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def publish(self, host: str, info: HostInfo) -> None:
        await self.client.set(keys.host_info(host), info.model_dump_json())
        note = Notification(kind="host", id=host, version=0)
        await self.client.publish(keys.host_notifications(host), note.model_dump_json())

    async def get(self, host: str) -> HostInfo | None:
        """The host's info; None before its hostd first started."""
        key = keys.host_info(host)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(HostInfo, raw, key)

    async def join(self, host: str) -> None:
        """Count `host` among the hosts the control plane plans for and routes to."""
        await self.client.sadd(keys.hosts(), host)

    async def hosts(self) -> set[str]:
        """The hosts that joined."""
        return {_text(host) for host in await self.client.smembers(keys.hosts())}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
