"""Whether a parked engine let go of its device memory, as memwatch sees it.

An engine's park control can answer success while the bytes stay on the device (allocator
pools kept, a driver that never frees). The scheduler charges a parked instance only its
parked charge, so a park counts only once a memwatch reading taken after the park control
returned shows the engine's processes on its GPU within that charge.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from dataclasses import dataclass

from redis.asyncio.client import PubSub

from capycommon.domain.instances import InstanceRecord
from capycommon.domain.memory import MemoryReading
from capycommon.state import memory
from capycommon.state.memory import MemoryStore
from capycommon.state.stores import State
from capycommon.units import format_duration, format_size
from capyctl_hostd import procs

# memwatch announces each reading, and reads often once asked; should an announcement be
# lost (a memwatch restarting, a broken subscription), hostd reads again after this long.
UNANNOUNCED_S = 0.5


@dataclass(frozen=True)
class Seen:
    """What memwatch showed of a parked engine's device bytes."""

    # The GPU that holds the most of them: gpu<index> once any reading named it, else its UUID.
    gpu: str
    # The most it holds on any one GPU of its set, from the latest fresh reading after the
    # park; None: none came.
    held_bytes: int | None

    def within(self, bound: int) -> bool:
        return self.held_bytes is not None and self.held_bytes <= bound


def observe(
    seen: Seen,
    reading: MemoryReading | None,
    gpu_uuids: Collection[str],
    pids: Collection[int],
    since: float,
    now: float,
) -> Seen:
    """`seen` after one more reading: the bytes `pids` hold on the fullest GPU of
    `gpu_uuids` (each rank of an engine across several GPUs keeps its own share), when the
    reading was taken after `since` and is still fresh at `now` (else the figure stays)."""
    gpus = [] if reading is None else [g for g in reading.gpus if g.uuid in gpu_uuids]
    if reading is None or not gpus or len(gpus) < len(gpu_uuids):
        return seen
    if not (reading.taken_at > since and reading.is_fresh(now)):
        named = seen.gpu if seen.held_bytes is not None else f"gpu{gpus[0].index}"
        return Seen(named, seen.held_bytes)
    held, fullest = max((sum(g.processes.get(pid, 0) for pid in pids), -g.index) for g in gpus)
    return Seen(f"gpu{-fullest}", held)


async def watch(
    state: State,
    record: InstanceRecord,
    pgid: int,
    bound: int,
    verify_s: float,
    since: float,
) -> Seen:
    """Ask memwatch for readings, and read each it announces, until one taken after `since`
    shows the live members of process group `pgid` holding at most `bound` bytes on each GPU
    of the instance, or until `verify_s` passed; returns the last figures seen."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + verify_s
    gpu_uuids = record.devices
    seen = Seen(",".join(gpu_uuids) or "the instance's GPU", None)
    # Subscribed before asking, so no reading taken after the ask goes unheard.
    async with state.memory.announced(record.host) as pubsub:
        await state.memory.ask_readings(record.host, record.member)
        while True:
            reading = await state.memory.reading(record.host)
            # Only the processes the reading names on the GPUs can hold their bytes: those of
            # the group are found from their own /proc entries, not a walk of /proc per
            # reading (one every few milliseconds while the park is verified).
            members = procs.in_group(_on_gpus(reading, gpu_uuids), pgid)
            seen = observe(seen, reading, gpu_uuids, members, since, time.time())
            if seen.within(bound) or loop.time() >= deadline:
                return seen
            wait = min(UNANNOUNCED_S, deadline - loop.time())
            await _next_reading(pubsub, loop.time() + wait)


def _on_gpus(reading: MemoryReading | None, gpu_uuids: Collection[str]) -> list[int]:
    """The processes the reading shows holding memory on the GPUs."""
    if reading is None:
        return []
    return sorted({pid for gpu in reading.gpus if gpu.uuid in gpu_uuids for pid in gpu.processes})


async def _next_reading(pubsub: PubSub, until: float) -> None:
    """Return when memwatch announces a reading, or at `until` (loop time)."""
    loop = asyncio.get_running_loop()
    while (left := until - loop.time()) > 0:
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
        if memory.kind_of(message) == "reading":
            return


# How long a stop waits for memwatch to show none of its engine's processes on its GPUs.
CLEARED_S = 5.0


async def cleared(
    memory: MemoryStore,
    record: InstanceRecord,
    pids: Collection[int],
    since: float,
    wait_s: float = CLEARED_S,
) -> str | None:
    """Once an engine's processes are gone: wait until a memwatch reading taken after `since`
    shows none of `pids` on any GPU of the instance (each rank's device), so a stop counts its
    memory released only once every device shows it free. None once seen (or at once where
    memwatch keeps no fresh reading: nothing measures there); else the GPUs still showing
    them after `wait_s`."""
    gpu_uuids, gone = record.devices, set(pids)
    latest = await memory.reading(record.host)
    if not gpu_uuids or not gone or latest is None or not latest.is_fresh(time.time()):
        return None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    async with memory.announced(record.host) as pubsub:
        await memory.ask_readings(record.host, record.member)
        while True:
            reading = await memory.reading(record.host)
            fresh = reading is not None and reading.taken_at > since
            held = [] if reading is None else _holding(reading, gpu_uuids, gone)
            if fresh and not held:
                return None
            if loop.time() >= deadline:
                return ", ".join(held) if fresh else "no fresh reading"
            await _next_reading(pubsub, min(loop.time() + UNANNOUNCED_S, deadline))


def _holding(reading: MemoryReading, gpu_uuids: Collection[str], pids: set[int]) -> list[str]:
    """The GPUs of `gpu_uuids` where the reading shows any of `pids`."""
    return [
        f"gpu{gpu.index}"
        for gpu in reading.gpus
        if gpu.uuid in gpu_uuids and not pids.isdisjoint(gpu.processes)
    ]


def judge(seen: Seen, bound: int, verify_s: float, residency: str) -> tuple[bool, str]:
    """(whether the park counts, the reason for its event), with the figures."""
    held, charge, after = seen.held_bytes, format_size(bound), format_duration(verify_s)
    if held is None:
        return False, (
            f"park: memory release unobserved: no fresh memwatch reading of {seen.gpu} "
            f"within {after} (parked charge {charge})"
        )
    if held <= bound:
        return True, (
            f"parked ({residency}): {format_size(held)} left on {seen.gpu}, "
            f"within the {charge} parked charge"
        )
    return False, (
        f"park: memory not released: {format_size(held)} still held on {seen.gpu} "
        f"after {after} (parked charge {charge})"
    )
