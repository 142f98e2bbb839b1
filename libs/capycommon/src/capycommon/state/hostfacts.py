"""What a host's models are, as its hostd read them: the facts a deployment resolves against,
so the scheduler plans for any host from Redis alone and never reads a host's disk.

hostd writes one `HostModels` record under its host's prefix when it starts and whenever
what it read changes (it looks again every few seconds): every model under its models root,
and each path the control plane asked it to describe (`commands.Describe`), such as a
folder outside the root that a deployment names. The scheduler reads it with each snapshot.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.models import HostModels
from capycommon.domain.notifications import Notification
from capycommon.state import keys
from capycommon.state.hostrecord import HostRecordStore


class HostModelsStore(HostRecordStore[HostModels]):
    """Each host's models, as its hostd read them."""

    def __init__(self, client: aioredis.Redis) -> None:
        super().__init__(client, keys.host_models, HostModels)

    async def publish(self, host: str, models: HostModels) -> None:
        await self._put(host, models, Notification(kind="models", id=host, version=0))
