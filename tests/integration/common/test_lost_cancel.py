"""A loop writing to a real Redis through a service's client ends when its owner cancels it.
On Python 3.11, redis-py writes each command through `asyncio.wait_for`, which drops a cancel
that arrives as the write completes (CPython gh-86296); the loop then ran on, and hostd's
download, the router's table and the scheduler's reader each waited for it forever."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

import pytest

from capycommon.service import REDIS_ERRORS, redis_client
from capycommon.tasks import cancel_and_wait

pytestmark = pytest.mark.anyio
# A busy writer loses about one cancel in three here: without the cancel again, each round
# may hang, and ten rounds hang with a chance of 98 %.
ROUNDS = 10


async def test_a_loop_of_redis_writes_ends_on_each_cancel(redis_socket: Path) -> None:
    client = redis_client(f"unix://{redis_socket}")
    try:

        async def write_on() -> None:
            while True:
                await asyncio.sleep(0.001)
                with contextlib.suppress(*REDIS_ERRORS):
                    await client.set("figures", "x" * 100)

        chance = random.Random(0)
        for _ in range(ROUNDS):
            writer = asyncio.create_task(write_on())
            await asyncio.sleep(chance.random() * 0.003)
            async with asyncio.timeout(20):
                await cancel_and_wait(writer)
            assert writer.cancelled()
    finally:
        await client.aclose()
