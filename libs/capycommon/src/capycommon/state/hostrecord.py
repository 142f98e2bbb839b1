"""A record one host's hostd publishes under its prefix, one value a host: written whole, with a
notification on the host's channel so readers look again, and read back checked
(`capycommon.state.quarantine`). The host's engines and its models are such records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel

from capycommon.domain.notifications import Notification
from capycommon.state import keys, quarantine

R = TypeVar("R", bound=BaseModel)


class HostRecordStore(Generic[R]):
    """The store of one kind of host record: `key` names a host's, `model` checks it."""

    def __init__(self, client: aioredis.Redis, key: Callable[[str], str], model: type[R]) -> None:
        self.client = client
        self.key = key
        self.model = model

    async def _put(self, host: str, record: R, note: Notification) -> None:
        await self.client.set(self.key(host), record.model_dump_json())
        await self.client.publish(keys.host_notifications(host), note.model_dump_json())

    async def get(self, host: str) -> R | None:
        """The host's record; None before its hostd first published it."""
        key = self.key(host)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(self.model, raw, key)
