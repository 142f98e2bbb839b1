"""memwatch's two loops: a reading every second, startup-peak samples every 500 ms.

memwatch observes and writes; it decides nothing. A reading it cannot take is not written,
so the host's memory goes unobserved after `STALE_AFTER_S` rather than being guessed.
Readings are not announced on pub/sub: they come every second, readers read the key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

import redis.asyncio as aioredis
from pydantic import ValidationError

from capycommon.errors import DeviceUnobserved
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state import memory
from capycommon.state.instances import InstanceRecord
from capycommon.state.memory import MemoryReading, StartupPeak
from capycommon.state.store import InstanceStore
from capyctl_memwatch import peaks
from capyctl_memwatch.backends import Backend
from capyctl_memwatch.peaks import PeakSampler
from capyctl_memwatch.procs import GroupMeter

log = logging.getLogger(__name__)

READING_INTERVAL_S = 1.0


async def every(interval: float, stop: asyncio.Event, step: Callable[[], Awaitable[None]]) -> None:
    """Run `step` every `interval` seconds on a steady schedule until `stop` is set."""
    next_at = time.monotonic()
    while not stop.is_set():
        await step()
        next_at += interval
        now = time.monotonic()
        next_at = max(next_at, now)  # fell behind: carry on from now, without a burst
        if await wait_event(stop, next_at - now):
            return


class Readings:
    """Takes one reading of the host and writes it to Redis (`memory.write_reading`)."""

    def __init__(self, client: aioredis.Redis, host: str, backend: Backend) -> None:
        self.client = client
        self.host = host
        self.backend = backend
        self.failing: str | None = None

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
            await memory.write_reading(self.client, reading)


class Peaks:
    """Feeds the host's instance records to the sampler and stores the peaks it measures."""

    def __init__(self, client: aioredis.Redis, host: str, sampler: PeakSampler) -> None:
        self.client = client
        self.host = host
        self.sampler = sampler
        self.pending: list[StartupPeak] = []
        self.refused: set[str] = set()

    async def step(self) -> None:
        try:
            records = await self.load()
        except REDIS_ERRORS:
            return
        first = self.sampler.last_step is None
        measured = await asyncio.to_thread(self.sampler.tick, records, time.time())
        if first:
            log.info("watching launches", extra={"interval_s": peaks.INTERVAL_S})
        self.pending.extend(measured)
        while self.pending:
            peak = self.pending[0]
            try:
                await memory.write_startup_peak(self.client, peak)
            except REDIS_ERRORS:
                return  # kept for the next step
            self.pending.pop(0)
            log.info("startup peak measured", extra=peak.model_dump(mode="json"))

    async def load(self) -> list[InstanceRecord]:
        """The host's instance records (hostd writes them; a malformed one is skipped)."""
        records = []
        for member, raw in await InstanceStore(self.client, self.host).raws():
            try:
                records.append(InstanceRecord.model_validate_json(raw))
            except ValidationError as exc:
                if member not in self.refused:
                    extra = {"member": member, "error": str(exc)}
                    log.warning("unreadable instance record", extra=extra)
                self.refused.add(member)
        return records


async def watch(client: aioredis.Redis, host: str, backend: Backend, stop: asyncio.Event) -> None:
    """Run both loops until `stop` is set."""
    readings = Readings(client, host, backend)
    sampler = PeakSampler(host, GroupMeter(backend.read))
    startup = Peaks(client, host, sampler)
    await asyncio.gather(
        every(READING_INTERVAL_S, stop, readings.step),
        every(peaks.INTERVAL_S, stop, startup.step),
    )
