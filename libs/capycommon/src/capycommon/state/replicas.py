"""The primary's replicas: whether a write reached one, and how far each lags.

A declaration the management API acknowledges must survive the loss of the primary, so it is
acknowledged only once a replica holds it. Redis's WAIT counts the replicas that acknowledged
every write of the connection it is sent on; a pool hands out any of its connections, so
`confirm` writes a probe and waits on one connection (a pipeline without a transaction is
sent on one): replication is one ordered stream, and a replica that holds the probe holds
everything written before it, the declaration included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from capycommon.state import keys


@dataclass(frozen=True)
class ReplicaLag:
    """One replica as its primary sees it."""

    address: str
    state: str
    # Bytes of the replication stream it has yet to acknowledge.
    behind_bytes: int
    # Seconds since it last acknowledged.
    lag_s: int


@dataclass(frozen=True)
class ReplicationInfo:
    role: str
    replicas: tuple[ReplicaLag, ...]


class ReplicaStore:
    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def confirm(self, replicas: int, timeout_s: float) -> int:
        """Wait up to `timeout_s` until `replicas` replicas hold every write made so far;
        how many do (fewer once the time is up)."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.incr(keys.replication_probe())
            pipe.execute_command("WAIT", replicas, max(1, round(timeout_s * 1000)))
            _, acknowledged = await pipe.execute()
        return int(acknowledged)

    async def info(self) -> ReplicationInfo:
        """What the Redis this client reaches says of its replication."""
        found: dict[str, Any] = await self.client.info("replication")
        offset = _number(found.get("master_repl_offset"))
        replicas = []
        for name, value in sorted(found.items()):
            if name.startswith("slave") and isinstance(value, dict):
                host, port = value.get("ip", "?"), value.get("port", "?")
                replicas.append(
                    ReplicaLag(
                        address=f"{host}:{port}",
                        state=str(value.get("state", "?")),
                        behind_bytes=max(0, offset - _number(value.get("offset"))),
                        lag_s=_number(value.get("lag")),
                    )
                )
        return ReplicationInfo(role=str(found.get("role", "?")), replicas=tuple(replicas))


def _number(value: object) -> int:
    """INFO's figure as a whole number; 0 for one that is not (INFO is Redis's own text)."""
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        return 0
