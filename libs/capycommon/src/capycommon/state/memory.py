"""Memory readings (memwatch) and measured startup peaks, and where they live in Redis.

memwatch writes one `MemoryReading` per second per host at `keys.memory(host)`, more often
while hostd verifies a park, and announces each on the host's memory channel
(`keys.memory_notifications(host)`: `{kind: reading}`), where hostd asks for them
(`{kind: verify}`) when an engine's park call returned; it writes one `StartupPeak` per
measured launch at `keys.startup_peak(...)`. A reading older than `STALE_AFTER_S` is
unobserved.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.asyncio.client import PubSub

from capycommon.domain.instances import InstanceRecord
from capycommon.domain.memory import MemoryReading, StartupPeak
from capycommon.domain.notifications import Notification
from capycommon.state import keys, notify, quarantine

# How many startup peaks one read asks for.
PEAKS_AT_ONCE = 1000


class MemoryStore:
    """Each host's memory readings, measured startup peaks and LMCache servers' sizes."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def write_reading(self, reading: MemoryReading) -> None:
        """Write the host's reading and announce it, in one round trip."""
        note = Notification(kind="reading", id=reading.host, version=int(reading.taken_at * 1000))
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(keys.memory(reading.host), reading.model_dump_json())
            pipe.publish(keys.memory_notifications(reading.host), note.model_dump_json())
            await pipe.execute()

    async def ask_readings(self, host: str, member: str) -> None:
        """Ask the host's memwatch for a reading now, and often until no instance parks: an
        engine's park call returned and hostd waits to see the memory released."""
        note = Notification(kind="verify", id=member, version=int(time.time() * 1000))
        await self.client.publish(keys.memory_notifications(host), note.model_dump_json())

    @asynccontextmanager
    async def announced(self, host: str) -> AsyncIterator[PubSub]:
        """A subscription to the host's memory channel, closed on leaving (see `kind_of`)."""
        async with notify.subscribed(self.client, [keys.memory_notifications(host)]) as pubsub:
            yield pubsub

    async def reading(self, host: str) -> MemoryReading | None:
        """The host's latest reading, or None when memwatch never wrote one."""
        key = keys.memory(host)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(MemoryReading, raw, key)

    async def write_startup_peak(self, peak: StartupPeak) -> None:
        key = keys.startup_peak(peak.host, peak.deployment, peak.revision, peak.fingerprint)
        await self.client.set(key, peak.model_dump_json())

    async def startup_peak(
        self, host: str, deployment: str, revision: int, fingerprint: str
    ) -> StartupPeak | None:
        key = keys.startup_peak(host, deployment, revision, fingerprint)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(StartupPeak, raw, key)

    async def startup_peaks(
        self, wanted: Sequence[tuple[str, str, int, str]]
    ) -> list[StartupPeak | None]:
        """The startup peaks of (host, deployment, revision, fingerprint) each, read at once
        (in batches of PEAKS_AT_ONCE keys)."""
        found: list[StartupPeak | None] = []
        names = [keys.startup_peak(*each) for each in wanted]
        for start in range(0, len(names), PEAKS_AT_ONCE):
            batch = names[start : start + PEAKS_AT_ONCE]
            raws = await self.client.mget(batch) if batch else []
            found += [
                None if raw is None else quarantine.parse(StartupPeak, raw, key)
                for key, raw in zip(batch, raws, strict=True)
            ]
        return found

    async def instance_peak(self, host: str, deployment: str, index: int) -> StartupPeak | None:
        """The startup peak measured for the launch an instance record names (its revision
        and engine build), or None while the record or the peak is missing (or refused)."""
        key = keys.instance(host, deployment, index)
        raw = await self.client.get(key)
        found = None if raw is None else quarantine.parse(InstanceRecord, raw, key)
        if found is None or found.fingerprint is None:
            return None
        return await self.startup_peak(host, deployment, found.revision, found.fingerprint)

    async def write_cache_server_rss(self, host: str, fingerprint: str, size: int) -> None:
        """The resident memory an LMCache server of this build was measured at (its pool
        aside)."""
        await self.client.set(keys.cache_server_rss(host, fingerprint), str(size))

    async def cache_server_rss(self, host: str, fingerprint: str) -> int | None:
        key = keys.cache_server_rss(host, fingerprint)
        raw = await self.client.get(key)
        if raw is None:
            return None
        if not raw.isdigit() or len(raw) > 20:
            quarantine.REFUSALS.refuse(key, raw, "not a size in bytes")
            return None
        return int(raw)


def kind_of(message: dict[str, object] | None) -> str | None:
    """The kind of a message on a memory channel (`reading` or `verify`), else None."""
    if message is None or message.get("type") != "message":
        return None
    data = message.get("data")
    if not isinstance(data, bytes | str):
        return None
    try:
        return Notification.model_validate_json(data).kind
    except ValidationError:
        return None
