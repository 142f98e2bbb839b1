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


async def aread(client: aioredis.Redis) -> HostMarks:
    async with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(keys.unreachable_hosts())
        pipe.smembers(keys.drained_hosts())
        unreachable, drained = await pipe.execute()
    marked = {_text(host): _since(since) for host, since in unreachable.items()}
    return HostMarks(
        unreachable={host: since for host, since in marked.items() if since is not None},
        drained=frozenset(_text(host) for host in drained),
    )


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


async def mark_unreachable(client: aioredis.Redis, host: str, since: float) -> None:
    """Mark `host` unreachable since `since`, unless it already is (the first time stands)."""
    if await client.hsetnx(keys.unreachable_hosts(), host, repr(since)):
        await _announce(client, host)


async def mark_reachable(client: aioredis.Redis, host: str) -> None:
    if await client.hdel(keys.unreachable_hosts(), host):
        await _announce(client, host)


async def set_drained(client: aioredis.Redis, host: str, drained: bool) -> bool:
    """Drain or undrain `host`; whether that changed anything."""
    if drained:
        changed = bool(await client.sadd(keys.drained_hosts(), host))
    else:
        changed = bool(await client.srem(keys.drained_hosts(), host))
    if changed:
        await _announce(client, host)
    return changed


async def _announce(client: aioredis.Redis, host: str) -> None:
    note = Notification(kind="host", id=host, version=0)
    await client.publish(keys.notifications(), note.model_dump_json())


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
