"""Reading a stream as a consumer group: first the entries delivered but never acknowledged
(a reader that restarts takes them up again), then new ones; an entry is acknowledged when
its reader is done with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

Fields = dict[bytes, bytes]
Entry = tuple[str, Fields]
_Read = list[tuple[bytes, list[tuple[bytes, Fields]]]]


@dataclass(frozen=True)
class Group:
    client: aioredis.Redis
    stream: str
    name: str
    consumer: str

    async def ensure(self) -> None:
        """Create the group (and the stream) unless it exists."""
        try:
            await self.client.xgroup_create(self.stream, self.name, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, cursor: str, count: int, block_ms: int | None = None) -> list[Entry]:
        """Entries after `cursor` ("0": those delivered and not acknowledged; ">": new ones).
        Raises ResponseError NOGROUP when Redis lost the group."""
        read = await self.client.xreadgroup(
            self.name, self.consumer, {self.stream: cursor}, count=count, block=block_ms
        )
        found = cast(_Read, read)[0][1] if read else []
        return [(entry_id.decode(), fields) for entry_id, fields in found]

    async def ack(self, *entry_ids: str) -> None:
        if entry_ids:
            await self.client.xack(self.stream, self.name, *entry_ids)
