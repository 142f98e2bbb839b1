"""hostd's reading of its command stream against a real redis-server that is not there yet
when it starts: making the group is retried as a read is, never the end of hostd."""

from __future__ import annotations

import asyncio
import shutil
from types import SimpleNamespace
from typing import cast

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from capycommon.state import hostcommands, keys
from capycommon.state.stores import State
from capyctl_hostd.consumer import consume
from capyctl_hostd.modelfacts import Shelf
from capyctl_hostd.runner import Runner
from support import redis_server, short_dir, wait_for_async


@pytest.mark.anyio
async def test_the_group_is_made_once_redis_comes() -> None:
    folder = short_dir("consumer")
    # No retries of its own: each failed try reaches the consumer.
    where = str(folder / "redis.sock")
    client = aioredis.Redis(unix_socket_path=where, socket_timeout=2, retry=Retry(NoBackoff(), 0))
    runner = cast(Runner, SimpleNamespace(state=State(client), host="local"))
    # First a socket that closes every connection it takes, as a Redis going away does.
    tries = 0

    def refuse(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal tries
        tries += 1
        writer.close()

    refusing = await asyncio.start_unix_server(refuse, path=where)
    stop = asyncio.Event()
    reading = asyncio.create_task(consume(runner, cast(Shelf, None), stop))
    server = None
    try:

        async def tried_again() -> bool:
            return tries >= 2 or reading.done()

        await wait_for_async(tried_again, timeout=10, what="a second try", interval=0.02)
        assert not reading.done(), "the consumer ended while Redis was away"
        refusing.close()
        await refusing.wait_closed()
        server = await asyncio.to_thread(redis_server, folder)
        # A malformed command: dropped, and acknowledged, without a runner's work.
        entry = await client.xadd(keys.host_commands("local"), {hostcommands.FIELD: "{}"})

        async def acknowledged() -> bool:
            groups = await client.xinfo_groups(keys.host_commands("local"))
            return any(
                g["name"] == b"hostd" and g["last-delivered-id"] == entry and g["pending"] == 0
                for g in groups
            )

        await wait_for_async(acknowledged, timeout=10, what="the command read and acknowledged")
    finally:
        stop.set()
        await asyncio.wait_for(reading, 5)
        await client.aclose()
        if server is not None:
            server.terminate()
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)
