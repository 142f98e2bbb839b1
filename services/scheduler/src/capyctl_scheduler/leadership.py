"""One scheduler acts: the holder of the scheduler lease (`capycommon.state.leader`).

Every server runs a scheduler; each claims the lease every RENEW_S. The holder renews it, the
others find it held and wait. A holder that stops renewing (stopped, paused, cut off from
Redis) loses it LEASE_S after its last renewal, and another takes it at its next claim: a
new leader acts within LEASE_S + RENEW_S of the old one's last renewal. The holder counts
the lease as its own only until LEASE_S - MARGIN_S after it sent its last successful claim,
so it stops acting before Redis lets another take over; a process paused past that and
resumed acts on at most what it had begun, and its commands carry its old epoch, which hosts
refuse (`capyctl_hostd.fence`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Coroutine
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from capycommon.domain.leader import Lease
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state.leader import LeaderStore
from capycommon.tasks import cancel_and_wait

log = logging.getLogger(__name__)

LEASE_S = 5.0
RENEW_S = 1.0
# Room for the claim's own round trip and the clocks' drift over a lease.
MARGIN_S = 0.5
# How often work run only by the leader (`Leadership.during`) checks the lease is still held.
WATCH_S = 0.25

Work = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


@dataclass
class Leadership:
    store: LeaderStore
    # The server this scheduler runs on (`Lease.server`).
    server: str
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    # The epoch of the lease held, None while another holds it (or none is known).
    epoch: int | None = None
    # Set whenever this scheduler takes or loses the lease.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The lease as last read, whoever holds it.
    lease: Lease | None = None
    _until: float = 0.0  # monotonic: the lease counts as ours until then

    @property
    def held(self) -> bool:
        return self.epoch is not None and time.monotonic() < self._until

    async def claim(self) -> bool:
        """Claim (or renew) the lease once; whether this scheduler holds it now."""
        sent = time.monotonic()
        ours, self.lease = await self.store.claim(self.server, self.token, LEASE_S)
        if ours and self.lease is not None and self.lease.token == self.token:
            self._until = sent + LEASE_S - MARGIN_S
            if self.epoch != self.lease.epoch:
                self.epoch = self.lease.epoch
                log.info("took the scheduler lease", extra={"epoch": self.epoch})
                self.changed.set()
            return True
        self._lost(None if self.lease is None else self.lease.server)
        return False

    def lapse(self) -> None:
        """Note a lease that ran out unrenewed (Redis unreachable past it)."""
        if self.epoch is not None and not self.held:
            self._lost(None)

    async def run(self, stop: asyncio.Event) -> None:
        """Claim every RENEW_S until `stop`; a held lease is given up on the way out, so
        another server's scheduler takes over at its next claim."""
        try:
            while not stop.is_set():
                with suppress(*REDIS_ERRORS):
                    await self.claim()
                self.lapse()
                await wait_event(stop, RENEW_S)
        finally:
            if self.epoch is not None:
                with suppress(*REDIS_ERRORS):
                    await self.store.release(self.token)

    async def during(self, work: Work, stop: asyncio.Event) -> None:
        """Run `work` through each term this scheduler holds the lease, until `stop`: it is
        given an event set when the term ends (the lease lost, or `stop`), and a failure of
        it is this call's."""
        while not stop.is_set():
            if not self.held:
                await wait_event(stop, WATCH_S)
                continue
            term = asyncio.Event()
            running = asyncio.ensure_future(work(term))
            try:
                while self.held and not stop.is_set() and not running.done():
                    await asyncio.wait([running], timeout=WATCH_S)
            finally:
                term.set()
                await asyncio.wait([running], timeout=WATCH_S)
                await cancel_and_wait(running)
            if not running.cancelled():
                running.result()

    def _lost(self, holder: str | None) -> None:
        if self.epoch is None:
            return
        log.warning(
            "lost the scheduler lease; planning stops here",
            extra={"epoch": self.epoch, "holder": holder or "nobody"},
        )
        self.epoch = None
        self.changed.set()
