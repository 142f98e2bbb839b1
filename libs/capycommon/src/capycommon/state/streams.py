"""Reading a stream as a consumer group: first the entries delivered but never acknowledged
(a reader that restarts takes them up again), then new ones; an entry is acknowledged when
its reader is done with it."""

from __future__ import annotations

from dataclasses import dataclass, field
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


@dataclass
class Reader:
    """One consumer's reads of its group, losing no entry: Redis counts an entry delivered when
    it sends it, so a read that fails or is cancelled after that (its answer late past the
    socket timeout, the connection cut) leaves entries delivered to nobody who saw them. After
    any read that did not return, the next one reads the delivered history again ("0"), and
    hands out only the entries not already handed out and not yet acknowledged."""

    group: Group
    cursor: str = "0"
    # Entries handed out and not yet acknowledged.
    held: set[str] = field(default_factory=set)

    async def read(self, count: int, block_ms: int | None = None) -> list[Entry]:
        try:
            entries = await self.group.read(self.cursor, count, block_ms)
        except BaseException:
            self.cursor = "0"
            raise
        if self.cursor != ">":
            # First the history, after the last entry read; once it is read out, new entries.
            self.cursor = entries[-1][0] if entries else ">"
        fresh = [(entry_id, fields) for entry_id, fields in entries if entry_id not in self.held]
        self.held.update(entry_id for entry_id, _ in fresh)
        return fresh

    @property
    def in_history(self) -> bool:
        """Whether the next read is of the delivered history (which never blocks)."""
        return self.cursor != ">"

    async def ack(self, *entry_ids: str) -> None:
        await self.group.ack(*entry_ids)
        self.held.difference_update(entry_ids)
