"""Pub/sub notifications: they carry only what changed, never the state itself."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from capycommon.state import keys


def host_channel(host: str) -> str:
    """The channel of one host's own announcements (all a host's Redis user may follow)."""
    return keys.host_notifications(host)


def channels(hosts: Iterable[str]) -> dict[str, str]:
    """The channels to follow for the control plane and these hosts, each to the host it
    speaks for ("" for the control plane's own)."""
    found = {keys.notifications(): ""}
    found.update({keys.host_notifications(host): host for host in hosts})
    return found


@asynccontextmanager
async def subscribed(client: aioredis.Redis, names: Iterable[str]) -> AsyncIterator[PubSub]:
    """A subscription to these channels, closed on leaving."""
    async with client.pubsub() as pubsub:
        await pubsub.subscribe(*names)
        yield pubsub
