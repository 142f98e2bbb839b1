"""Engine load: the requests each serving engine runs and queues, as hostd publishes it.

hostd reads every ready or draining engine's own metrics once a second and keeps one
`EngineLoad` per `<deployment>:<index>` member in the hash `keys.engine_load(host)`; a member
leaves the hash when its instance stops serving. The scheduler reads it to know which
engines are busy and which have been idle longest. An entry names the instance's generation,
so a reader can tell it from one left by an earlier launch of the same member.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import redis.asyncio as aioredis

from capycommon.domain.hosts import EngineLoad
from capycommon.domain.notifications import Notification
from capycommon.state import keys, quarantine


def decode(raw: Mapping[bytes | str, bytes | str], key: str) -> dict[str, EngineLoad]:
    """The hash `key`'s entries by member (as HGETALL gives them, bytes or text), those
    that are no EngineLoad refused."""
    found = {
        _text(member): quarantine.parse(EngineLoad, value, key) for member, value in raw.items()
    }
    return {member: load for member, load in found.items() if load is not None}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class LoadStore:
    """Each host's published engine loads."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def get(self, host: str) -> dict[str, EngineLoad]:
        """The published load of each serving engine on the host, by member."""
        key = keys.engine_load(host)
        return decode(await self.client.hgetall(key), key)

    async def publish(
        self,
        host: str,
        entries: Mapping[str, EngineLoad],
        gone: Iterable[str],
        *,
        notify: bool = False,
    ) -> None:
        """Write these members' entries and remove those of engines no longer serving; with
        `notify`, say so on the host's channel (`{kind: load}`): the scheduler waits on a
        draining engine's reading to park or stop it, and re-plans the moment it comes."""
        key = keys.engine_load(host)
        gone = list(gone)
        async with self.client.pipeline(transaction=True) as pipe:
            if entries:
                pipe.hset(key, mapping={m: e.model_dump_json() for m, e in entries.items()})
            if gone:
                pipe.hdel(key, *gone)
            if notify:
                note = Notification(kind="load", id=host, version=int(time.time() * 1000))
                pipe.publish(keys.host_notifications(host), note.model_dump_json())
            await pipe.execute()
