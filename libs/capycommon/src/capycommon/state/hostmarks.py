"""What the control plane decided of its hosts: which joined hosts are unreachable (since
when), and which an operator drained. The scheduler writes both and announces each change
as `{kind: host, id: <host>}` on the control plane's channel; routers read them to send
nothing to an unreachable host."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from capycommon.domain.notifications import Notification
from capycommon.state import keys, quarantine


@dataclass(frozen=True)
class HostMarks:
    # host -> since when it is unreachable (Unix seconds).
    unreachable: dict[str, float] = field(default_factory=dict)
    drained: frozenset[str] = frozenset()


class HostMarkStore:
    """The control plane's marks on its hosts: unreachable since when, and drained."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def get(self) -> HostMarks:
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.unreachable_hosts())
            pipe.smembers(keys.drained_hosts())
            unreachable, drained = await pipe.execute()
        marked = {_text(host): _since(since) for host, since in unreachable.items()}
        return HostMarks(
            unreachable={host: since for host, since in marked.items() if since is not None},
            drained=frozenset(_text(host) for host in drained),
        )

    async def mark_unreachable(self, host: str, since: float) -> None:
        """Mark `host` unreachable since `since`, unless it already is (the first time
        stands)."""
        if await self.client.hsetnx(keys.unreachable_hosts(), host, repr(since)):
            await self._announce(host)

    async def mark_reachable(self, host: str) -> None:
        if await self.client.hdel(keys.unreachable_hosts(), host):
            await self._announce(host)

    async def set_drained(self, host: str, drained: bool) -> bool:
        """Drain or undrain `host`; whether that changed anything."""
        if drained:
            changed = bool(await self.client.sadd(keys.drained_hosts(), host))
        else:
            changed = bool(await self.client.srem(keys.drained_hosts(), host))
        if changed:
            await self._announce(host)
        return changed

    async def _announce(self, host: str) -> None:
        note = Notification(kind="host", id=host, version=0)
        await self.client.publish(keys.notifications(), note.model_dump_json())


def _since(raw: bytes | str) -> float | None:
    """A mark's time; None (refused) for anything but a finite number."""
    try:
        since = float(raw)
    except ValueError:
        since = math.nan
    if not math.isfinite(since):
        quarantine.REFUSALS.refuse(keys.unreachable_hosts(), raw, "a mark that is not a time")
        return None
    return since


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
