"""The control plane's count of refused values (`capycommon.state.quarantine`), kept in
Redis so that the router's /metrics shows every control-plane process's refusals as one
counter, `capyctl_host_records_refused_total{host,kind}`."""

from __future__ import annotations

from collections import Counter
from typing import cast

import redis.asyncio as aioredis

from capycommon.state import keys
from capycommon.state.quarantine import REFUSALS, Refusals

# The most (host, kind) pairs read back: the kinds are the host prefix's key names, which a
# host chooses, so their count is bounded here.
MAX_PAIRS = 10_000


class RefusalStore:
    """The control plane's counts of refused values."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def send(self, refusals: Refusals = REFUSALS) -> None:
        """Add this process's refusals since its last send to the control plane's counts. On
        a Redis failure they are kept for the next send, and the failure raised."""
        unsent = refusals.drain()
        if not unsent:
            return
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for (host, kind), count in unsent.items():
                    pipe.hincrby(keys.refusals(), f"{host}:{kind}", count)
                await pipe.execute()
        except BaseException:
            refusals.keep(unsent)
            raise

    async def counts(self) -> Counter[tuple[str, str]]:
        """The control plane's counts by (host, kind); a field that is no count is passed
        over."""
        raw = cast(dict[bytes, bytes], await self.client.hgetall(keys.refusals()))
        counts: Counter[tuple[str, str]] = Counter()
        for field, value in list(raw.items())[:MAX_PAIRS]:
            host, _, kind = field.decode(errors="replace").rpartition(":")
            if value.isdigit() and len(value) < 20:
                counts[(host, kind)] = int(value)
        return counts
