"""Where the servers' Sentinels are, published in Redis for the hosts: each server's
scheduler writes the topology its settings give, and a joined host's hostd keeps it in the
host's joined file (`capycommon.joined`), so its services find the primary after a
failover, and after a server was added or replaced."""

from __future__ import annotations

import redis.asyncio as aioredis

from capycommon.domain.replication import Topology
from capycommon.state import keys, quarantine


class TopologyStore:
    """The servers' topology: one value, which hosts may read (`acl.READABLE`)."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def publish(self, topology: Topology) -> None:
        await self.client.set(keys.topology(), topology.model_dump_json())

    async def read(self) -> Topology | None:
        """The published topology; None when there is none (servers that do not replicate,
        or before a scheduler published it) or it cannot be one (refused)."""
        key = keys.topology()
        raw = await self.client.get(key)
        return None if raw is None else quarantine.parse(Topology, raw, key)
