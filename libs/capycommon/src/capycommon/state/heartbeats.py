"""Service heartbeats: who is alive, since when, last seen when."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from capycommon.domain.hosts import Heartbeat
from capycommon.state import keys, quarantine

# Three beats within the time to live, so a late one never makes a live service look gone;
# every Python process of a role beats (and a router worker keeps its places as often), so a
# quiet role's CPU counts each wake for it.
INTERVAL_S = 3.0
TTL_S = 10


class HeartbeatStore:
    """Each service's (and each router worker's) heartbeat, under its host."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def beat(self, host: str, heartbeat: Heartbeat, server: str = "") -> None:
        key = keys.heartbeat(heartbeat.service, host, server)
        await self.client.set(key, heartbeat.model_dump_json(), ex=TTL_S)

    async def clear(self, host: str, service: str, pid: int, server: str = "") -> None:
        """Remove a service's heartbeat, unless a newer process already wrote its own."""
        beat = await self.get(service, host, server)
        if beat is not None and beat.pid == pid:
            await self.client.delete(keys.heartbeat(service, host, server))

    async def alive(self, service: str, host: str) -> bool:
        """Whether `service` on `host` beat within the heartbeat's time to live."""
        return bool(await self.client.exists(keys.heartbeat(service, host)))

    async def get(self, service: str, host: str, server: str = "") -> Heartbeat | None:
        """The live heartbeat of `service` on `host` (a control service: on `server`), or
        None."""
        key = keys.heartbeat(service, host, server)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(Heartbeat, raw, key)

    async def of_services(
        self, host: str | None, services: list[str], server: str = ""
    ) -> dict[str, Heartbeat]:
        """The live heartbeats of `services` (host services need `host`; a replicated
        server's control services, `server`)."""
        found: dict[str, Heartbeat] = {}
        for service in services:
            if service not in keys.CONTROL_SERVICES | keys.HOST_SERVICES:
                continue
            if service in keys.HOST_SERVICES and host is None:
                continue
            beat = await self.get(service, host or "", server)
            if beat is not None:
                found[service] = beat
        return found

    async def workers(self, service: str, server: str = "") -> dict[str, Heartbeat]:
        """The live heartbeats of a control service's workers (on `server`), by name."""
        found: dict[str, Heartbeat] = {}
        async for key in self.client.scan_iter(match=keys.worker_heartbeats(service, server)):
            name = _text(key)
            raw = await self.client.get(name)
            beat = None if raw is None else quarantine.parse(Heartbeat, raw, name)
            if beat is not None:
                found[beat.service] = beat
        return found


def age(heartbeat: Heartbeat, now: float | None = None) -> float:
    return (time.time() if now is None else now) - heartbeat.last_seen


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
