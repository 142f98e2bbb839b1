"""Reading the host's command stream: at least once, acknowledged after each command ran.
Instance commands go to the runner, `Describe` to the models shelf, `Pull` and `Remove` to the
model store (after which the shelf looks again).

A fixed consumer name means a restarted hostd gets the commands its predecessor had taken
but not finished; the generation checks make a repeat harmless. A read that fails after Redis
sent its commands (its answer late past the socket timeout) loses none: the next read takes
them from the delivered history (`streams.Reader`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from redis.exceptions import ResponseError

from capycommon.domain.commands import Describe, HostCommand, Pull, Remove, TailLog
from capycommon.service import REDIS_ERRORS, unless_stopped, wait_event
from capycommon.state import hostcommands
from capycommon.state.streams import Entry, Fields, Reader
from capycommon.tasks import cancel_and_wait
from capyctl_hostd.fence import Fence
from capyctl_hostd.modelfacts import Shelf
from capyctl_hostd.runner import Runner

log = logging.getLogger(__name__)


async def consume(runner: Runner, shelf: Shelf, stop: asyncio.Event) -> None:
    reader = Reader(runner.state.commands.group(runner.host))
    fence = Fence(runner.state, runner.host)
    tasks: set[asyncio.Task[None]] = set()
    grouped = False
    try:
        while not stop.is_set():
            if not grouped:
                grouped = await _grouped(reader, stop)
                continue
            for entry_id, fields in await _read(reader, stop):
                task = asyncio.create_task(_run(runner, shelf, fence, reader, entry_id, fields))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
    finally:
        await cancel_and_wait(*tasks)


# How long one read of the stream blocks for new commands: a command wakes it at once, so
# only an idle hostd's round trips depend on it; well under the Redis client's 5 s socket
# timeout, which a busy machine's delays must not reach.
BLOCK_MS = 2000


async def _read(reader: Reader, stop: asyncio.Event) -> list[Entry]:
    """The next commands, or none once `stop` is set (the blocked read is cancelled then).
    Only new entries are blocked for: Redis answers a read of the history at once."""
    try:
        return await unless_stopped(reader.read(count=16, block_ms=BLOCK_MS), stop) or []
    except REDIS_ERRORS:
        await wait_event(stop, 0.5)  # the heartbeat decides when Redis was gone too long
    except ResponseError as exc:
        # Redis lost the group, or the stream under a blocked read: recreate them.
        if "NOGROUP" not in str(exc) and "UNBLOCKED" not in str(exc):
            raise
        await _grouped(reader, stop)  # if Redis failed, the next read finds it lost again
    return []


async def _grouped(reader: Reader, stop: asyncio.Event) -> bool:
    """Make the group (and the stream) unless they exist; False when Redis failed, after a
    pause: a blip while hostd starts is ridden out as one later is."""
    try:
        await reader.group.ensure()
    except REDIS_ERRORS:
        await wait_event(stop, 0.5)
        return False
    return True


async def _run(
    runner: Runner, shelf: Shelf, fence: Fence, reader: Reader, entry_id: str, fields: Fields
) -> None:
    try:
        command = hostcommands.parse(fields[hostcommands.FIELD.encode()])
        epoch = hostcommands.epoch_of(fields)
    except (KeyError, TypeError, ValueError) as exc:  # TypeError: trimmed (no fields)
        log.error("dropping a malformed command %s: %s", entry_id, exc)
    else:
        try:
            if await fence.admit(command, epoch):
                await _carry_out(runner, shelf, command)
        except REDIS_ERRORS as exc:
            # Left unacknowledged: a restarted hostd reads it again.
            log.warning("command %s interrupted by Redis: %s", entry_id, exc)
            return
        except Exception:
            # A bug of ours: logged, and acknowledged, so it is not carried out again and again.
            log.exception("command %s failed", entry_id)
    with contextlib.suppress(*REDIS_ERRORS):
        await reader.ack(entry_id)


async def _carry_out(runner: Runner, shelf: Shelf, command: HostCommand) -> None:
    if isinstance(command, Describe):
        await shelf.describe(command)
    elif isinstance(command, Pull):
        await runner.models.pull(command)
        await shelf.refresh()
    elif isinstance(command, Remove):
        await runner.models.remove(command)
        await shelf.refresh()
    elif isinstance(command, TailLog):
        await runner.tail_log(command)
    else:
        await runner.handle(command)
