"""What a host says of itself to the control plane: the host settings that decide how its
deployments resolve. hostd writes it under the host's prefix when it starts, before it
publishes its engines; the scheduler reads it with each snapshot."""

from __future__ import annotations

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict

from capycommon.state import keys, quarantine
from capycommon.state.notify import Notification


class HostInfo(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    # False where host.deep_park is off: nothing parks deep there, and no engine runs with
    # its development controls.
    deep_park: bool = True
    # False where host.lmcache is off; True where host.retention is zero (its deployments'
    # default): LMCache never starts for them.
    lmcache: bool = True
    retention_zero: bool = False
    # A joined host's ingress as the router dials it (host:port, `capycommon.ingress`);
    # None on a standalone role's own host, whose engines the router reaches on loopback.
    ingress: str | None = None


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
