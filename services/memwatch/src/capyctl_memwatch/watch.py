"""memwatch's two loops: a reading every 2 s (every 10 ms once hostd verifies a park), and
startup-peak samples every 500 ms while a launch is starting.

memwatch observes and writes; it decides nothing. A reading it cannot take is not written,
so the host's memory goes unobserved after `STALE_AFTER_S` rather than being guessed. Each
reading is announced on the host's memory channel, where hostd, once an engine's park call
returned, asks for a reading at once and often until no instance parks: a park counts only
once a reading taken after that call shows the memory released, and a switch waits on it.

The sampler reads the host's instance records only when hostd announces that one changed
(its channel, `capyctl:host:<host>:notify`) and every 500 ms while a launch is starting, so a
host with nothing starting costs nothing; it still looks every QUIET_S, should an
announcement be lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.memory import MemoryReading, StartupPeak
from capycommon.domain.notifications import announces
from capycommon.errors import DeviceUnobserved
from capycommon.service import REDIS_ERRORS, wait_any, wait_event
from capycommon.state import memory, notify
from capycommon.state.stores import State
from capycommon.tasks import beside
from capyctl_memwatch import peaks
from capyctl_memwatch.backends import Backend
from capyctl_memwatch.peaks import PeakSampler
from capyctl_memwatch.procs import GroupMeter

log = logging.getLogger(__name__)

# Two readings within a reading's freshness (`memory.STALE_AFTER_S`, 5 s), so one lost or late
# reading never leaves the host unobserved; the scheduler reserves by charges, never by sampled
# use, so an older reading delays no decision. A reading costs a few milliseconds of CPU: a
# quiet host reads half as often as once a second.
READING_INTERVAL_S = 2.0
# Once hostd asks (an engine's park call returned), a reading at once and then this often
# while an instance parks: the device can show a release late, each reading tells hostd, and
# a switch waits on the first that shows it (half this on average).
VERIFY_READING_S = 0.01
# With no launch starting, the sampler waits this long at most for hostd's announcement.
QUIET_S = 30.0


async def every(
    interval: Callable[[], float],
    stop: asyncio.Event,
    step: Callable[[], Awaitable[None]],
    hurry: asyncio.Event | None = None,
) -> None:
    """Run `step` every `interval()` seconds on a steady schedule until `stop` is set; at
    once when `hurry` is set (then cleared)."""
    next_at = time.monotonic()
    while not stop.is_set():
        await step()
        next_at += interval()
        now = time.monotonic()
        next_at = max(next_at, now)  # fell behind: carry on from now, without a burst
        if hurry is None:
            if await wait_event(stop, next_at - now):
                return
            continue
        await wait_any(hurry, stop, timeout=next_at - now)
        if hurry.is_set():
            hurry.clear()
            next_at = time.monotonic()


class Readings:
    """Takes one reading of the host and writes it to Redis (`MemoryStore.write_reading`), and
    follows hostd's asks for readings while it verifies a park."""

    def __init__(self, state: State, host: str, backend: Backend) -> None:
        self.state = state
        self.host = host
        self.backend = backend
        self.failing: str | None = None
        # When hostd last asked for readings (monotonic), until a step of the sampler begun
        # after it finds no instance parking; `asked` is set on each ask, for the loop to hurry.
        self.asked_at: float | None = None
        self.asked = asyncio.Event()

    def interval(self) -> float:
        return READING_INTERVAL_S if self.asked_at is None else VERIFY_READING_S

    def parked(self, looked_at: float) -> None:
        """No instance was parking at `looked_at` (monotonic): asks before it are answered."""
        if self.asked_at is not None and self.asked_at < looked_at:
            self.asked_at = None

    async def listen(self, stop: asyncio.Event) -> None:
        """Follow the host's memory channel: each ask hurries a reading."""
        while not stop.is_set():
            try:
                async with self.state.memory.announced(self.host) as pubsub:
                    async for message in pubsub.listen():
                        if memory.kind_of(message) == "verify":
                            self.asked_at = time.monotonic()
                            self.asked.set()
            except REDIS_ERRORS:
                pass
            await wait_event(stop, 1.0)

    async def step(self) -> None:
        try:
            observation = await asyncio.to_thread(self.backend.read)
        except DeviceUnobserved as exc:
            if self.failing is None:
                log.warning("no reading: %s", exc.message)
            self.failing = exc.message
            return
        if self.failing is not None:
            log.info("readings resumed")
            self.failing = None
        reading = MemoryReading(
            host=self.host,
            taken_at=time.time(),
            backend=self.backend.name,
            gpus=observation.gpus,
            ram=observation.ram,
        )
        # A lost Redis is the heartbeat task's to report (and to give up on, in time).
        with suppress(*REDIS_ERRORS):
            await self.state.memory.write_reading(reading)


class Peaks:
    """Feeds the host's instance records to the sampler and stores the peaks it measures:
    each time hostd announces that an instance changed, and every 500 ms while a launch is
    starting."""

    def __init__(self, state: State, host: str, sampler: PeakSampler) -> None:
        self.state = state
        self.host = host
        self.sampler = sampler
        self.pending: list[StartupPeak] = []
        self.changed = asyncio.Event()
        # Which subscription to the host's channel is confirmed (a new one after each break),
        # or None while there is none; and which one the last step began under.
        self.subscription: int | None = None
        self._subscriptions = 0
        self._last_under: int | None = None
        # Whether an instance of the host is parking, as of the last step, which tells the
        # readings (`on_parked`) when none is.
        self.parking = False
        self.on_parked: Callable[[float], None] = lambda looked_at: None

    async def run(self, stop: asyncio.Event) -> None:
        """Step on every announcement, every 500 ms while a launch is starting, and at least
        every QUIET_S, until `stop` is set."""
        async with beside(self.listen(stop), "memwatch's instance notifications"):
            while not stop.is_set():
                await self.step()
                busy = self.sampler.launches or self.parking
                interval = peaks.INTERVAL_S if busy else QUIET_S
                await wait_any(self.changed, stop, timeout=interval)
                self.changed.clear()

    async def listen(self, stop: asyncio.Event) -> None:
        """Follow the host's channel; every message wakes the sampler but an engine's load
        (hostd writes one every 200 ms while an engine drains, and a switch waits on the
        steps that follow it)."""
        # The host's own channel (hostd's announcements), not the control plane's.
        channels = [name for name, host in notify.channels([self.host]).items() if host]
        while not stop.is_set():
            try:
                async with notify.subscribed(self.state.client, channels) as pubsub:
                    async for message in pubsub.listen():
                        if message.get("type") == "subscribe":
                            self._subscriptions += 1
                            self.subscription = self._subscriptions
                        elif announces(message.get("data"), "load"):  # no instance changed
                            continue
                        self.changed.set()  # re-read: something may have changed unheard
            except REDIS_ERRORS:
                pass
            self.subscription = None
            self.changed.set()
            await wait_event(stop, 1.0)

    async def step(self) -> None:
        under = self.subscription  # before reading: a change after the read is announced
        watched = under is not None and under == self._last_under
        self._last_under = None
        looked_at = time.monotonic()
        try:
            records = await self.load()
        except REDIS_ERRORS:
            return
        self.parking = any(record.state == InstanceState.PARKING for record in records)
        if not self.parking:
            self.on_parked(looked_at)
        first = self.sampler.last_step is None
        measured = await asyncio.to_thread(self.sampler.tick, records, time.time(), watched)
        self._last_under = under
        if first:
            log.info("watching launches", extra={"interval_s": peaks.INTERVAL_S})
        self.pending.extend(measured)
        while self.pending:
            peak = self.pending[0]
            try:
                await self.state.memory.write_startup_peak(peak)
            except REDIS_ERRORS:
                return  # kept for the next step
            self.pending.pop(0)
            log.info("startup peak measured", extra=peak.model_dump(mode="json"))

    async def load(self) -> list[InstanceRecord]:
        """The host's instance records (hostd writes them; a malformed one is refused by the
        store, and skipped)."""
        return await self.state.instances(self.host).all()


async def watch(state: State, host: str, backend: Backend, stop: asyncio.Event) -> None:
    """Run both loops until `stop` is set."""
    readings = Readings(state, host, backend)
    sampler = PeakSampler(host, GroupMeter(backend.read))
    startup = Peaks(state, host, sampler)
    startup.on_parked = readings.parked
    async with beside(readings.listen(stop), "memwatch's requests for readings"):
        await asyncio.gather(
            every(readings.interval, stop, readings.step, readings.asked), startup.run(stop)
        )
