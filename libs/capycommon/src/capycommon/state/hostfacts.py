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
from capycommon.state import keys, quarantine


def _payload(host: str, models: HostModels) -> tuple[str, str]:
    note = Notification(kind="models", id=host, version=0)
    return models.model_dump_json(), note.model_dump_json()


class HostModelsStore:
    """Each host's models, as its hostd read them."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def publish(self, host: str, models: HostModels) -> None:
        value, note = _payload(host, models)
        await self.client.set(keys.host_models(host), value)
        await self.client.publish(keys.host_notifications(host), note)

    async def get(self, host: str) -> HostModels | None:
        """The host's models; None before its hostd first published them."""
        key = keys.host_models(host)
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(HostModels, raw, key)
