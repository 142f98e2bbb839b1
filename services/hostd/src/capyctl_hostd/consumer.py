"""Reading the host's command stream: at least once, acknowledged after each command ran.
Instance commands go to the runner, `Describe` to the models shelf.

A fixed consumer name means a restarted hostd gets the commands its predecessor had taken
but not finished; the generation checks make a repeat harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import cast

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ResponseError

from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state import hostcommands, keys
from capyctl_hostd.modelfacts import Shelf
from capyctl_hostd.runner import Runner

log = logging.getLogger(__name__)
GROUP = "hostd"
CONSUMER = "hostd"

Entries = list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]


async def ensure_group(client: aioredis.Redis, stream: str) -> None:
    try:
        await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def consume(runner: Runner, shelf: Shelf, stop: asyncio.Event) -> None:
    stream = keys.host_commands(runner.host)
    await ensure_group(runner.client, stream)
    tasks: set[asyncio.Task[None]] = set()
    cursor = "0"  # first what was delivered but never acknowledged, then new entries
    try:
        while not stop.is_set():
            read = await _read(runner, stream, cursor, stop)
            entries = cast(Entries, read)[0][1] if read else []
            if cursor == "0" and not entries:
                cursor = ">"
            for entry_id, fields in entries:
                task = asyncio.create_task(_run(runner, shelf, stream, entry_id, fields))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if cursor == "0" and entries:
                cursor = entries[-1][0].decode()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _read(runner: Runner, stream: str, cursor: str, stop: asyncio.Event) -> object:
    try:
        return await runner.client.xreadgroup(
            GROUP, CONSUMER, {stream: cursor}, count=16, block=500
        )
    except ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        await ensure_group(runner.client, stream)  # Redis lost the group: recreate it
    except REDIS_ERRORS:
        await wait_event(stop, 0.5)  # the heartbeat decides when Redis was gone too long
    return None


async def _run(
    runner: Runner, shelf: Shelf, stream: str, entry_id: bytes, fields: dict[bytes, bytes]
) -> None:
    try:
        command = hostcommands.parse(fields[hostcommands.FIELD.encode()])
    except (KeyError, ValidationError) as exc:
        log.error("dropping a malformed command %s: %s", entry_id.decode(), exc)
    else:
        try:
            if isinstance(command, hostcommands.Describe):
                await shelf.describe(command)
            else:
                await runner.handle(command)
        except REDIS_ERRORS as exc:
            # Left unacknowledged: a restarted hostd reads it again.
            log.warning("command %s interrupted by Redis: %s", entry_id.decode(), exc)
            return
    with contextlib.suppress(*REDIS_ERRORS):
        await runner.client.xack(stream, GROUP, entry_id)
