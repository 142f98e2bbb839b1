"""Each joined host's share of the server's Redis (`enrollment.host_quota`).

A host's Redis user may write anything under its own prefix, so nothing but a measure bounds
how much memory it takes (a single value is bounded by the server Redis's
proto-max-bulk-len). Every SWEEP_EVERY_S the scheduler measures each joined host's keys:
it walks the prefix with SCAN, BATCH keys at a time, asks MEMORY USAGE of each, and pauses
PACE_S between batches, so a sweep costs Redis a few short commands a host and leaves it to
serve everyone else between them. Strings, lists and streams are counted whole (SAMPLES 0:
their cost grows with their nodes of several KiB, not their elements, and no order of
elements hides a size), hashes and sets from SAMPLED of their fields: counting a million
fields whole held Redis 0.6 s, SAMPLED of them 1 ms, within 2% (their fields come in the
order of Redis's seeded hash, which a host cannot choose). A host found over its quota is
cut off as a revocation does it (its
certificate's serial revoked, its Redis user deleted and its connections closed), and its
keys are dropped (UNLINK, freed in Redis's background), as they hold more than its share
and would cut off a recovered host again, but for the records of its live engines, which run
on and stay charged; it is logged once, with the host's name, and
recorded in the scheduler's choice stream. It comes back as a revoked host does
(`capyctl invite host NAME --recover`).

Between two sweeps a host may write past its quota: by as much as it can send in
SWEEP_EVERY_S.
"""

from __future__ import annotations

import asyncio
import logging
import time

from capycommon.domain.desired import Choice
from capycommon.domain.instances import LIVE_STATES
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state.stores import State
from capycommon.units import format_size
from capyctl_scheduler.enroll import Enrollment

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 10.0
CUT_OFF = "host_over_quota"


class HostQuota:
    def __init__(self, state: State, enrollment: Enrollment, quota: int) -> None:
        self.state = state
        self.enrollment = enrollment
        self.quota = quota

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.sweep()
            except REDIS_ERRORS as exc:
                log.debug("host quotas: Redis unavailable; measuring again later: %s", exc)
            await wait_event(stop, SWEEP_EVERY_S)

    async def sweep(self) -> list[str]:
        """Measure every joined host that is not revoked; cut off those over the quota.
        Returns the names of those cut off."""
        cut = []
        for name in sorted(await self.state.host_info.hosts()):
            identity = await self.state.identities.get(name)
            if identity is None or identity.revoked_at is not None:
                continue  # not a joined host (a server's own), or cut off already
            used = await self.state.host_keys.size(name, over=self.quota)
            if used > self.quota:
                await self.cut_off(name, used)
                cut.append(name)
        return cut

    async def cut_off(self, host: str, used: int) -> None:
        await self.enrollment.revoke(host)
        # Its engines run on, as a revoked host's do: the records of the live ones are kept
        # (the few KiB each that the store believes), so their memory stays charged.
        store = self.state.instances(host)
        kept = [r for r in await store.all() if r.state in LIVE_STATES or r.cache is not None]
        await self.state.host_keys.drop(host)
        for record in kept:
            await store.keep(record)
        reason = (
            f"its keys took {format_size(used)} or more of the server's Redis, over its quota "
            f"of {format_size(self.quota)} (enrollment.host_quota): revoked, its keys dropped"
        )
        choice = Choice(kind=CUT_OFF, deployment="", host=host, reason=reason, at=time.time())
        await self.state.deployments.chose(choice.model_dump_json())
        log.error(
            "cut off host %s: %s", host, reason, extra={"used_bytes": used, "quota": self.quota}
        )
