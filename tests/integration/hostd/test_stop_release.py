"""A stop counts its engine's memory released only once memwatch shows none of the engine's
processes on any GPU of its set, read from a real Redis as hostd reads it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import redis.asyncio as aioredis

from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.state.memory import MemoryStore
from capyctl_hostd.release import cleared
from unit.readings import GiB, held_reading

RANKS = {10, 11}
RECORD = InstanceRecord(
    deployment="big",
    instance=0,
    revision=1,
    generation=1,
    state=InstanceState.STOPPING,
    since=0.0,
    host="h",
    gpu_uuid="GPU-0",
    gpu_uuids=("GPU-0", "GPU-1"),
)


def test_a_stop_waits_for_a_reading_after_it_that_shows_every_rank_gone(
    redis_socket: Path,
) -> None:
    async def run() -> None:
        client = aioredis.Redis(unix_socket_path=str(redis_socket))
        memory = MemoryStore(client)
        try:
            # Nothing measures here (no reading): the stop does not wait.
            assert await cleared(memory, RECORD, RANKS, time.time(), wait_s=5) is None
            since = time.time()
            await memory.write_reading(
                held_reading(since - 0.1, {0: {10: 9 * GiB}, 1: {11: 9 * GiB}})
            )
            waiting = asyncio.create_task(cleared(memory, RECORD, RANKS, since, wait_s=10))
            await asyncio.sleep(0)
            assert not waiting.done(), "a reading from before the stop proves nothing"
            await memory.write_reading(held_reading(time.time(), {0: {}, 1: {99: GiB}}))
            assert await asyncio.wait_for(waiting, timeout=5) is None
            # A rank the reading still shows, after the wait: named, for hostd's log.
            since = time.time()
            await memory.write_reading(held_reading(since + 0.01, {0: {}, 1: {11: 9 * GiB}}))
            assert await cleared(memory, RECORD, RANKS, since, wait_s=0.3) == "gpu1"
        finally:
            await client.aclose()

    asyncio.run(run())
