"""Publishing each serving engine's load: its running and waiting requests, once a second.

The scheduler needs to know which engines are busy (never switch them out) and which have
been idle longest, without talking to engines itself. hostd already holds each engine's
address and key, so it reads the engine's own metrics and keeps the host's load hash
(`capycommon.state.load`) current: an entry per ready or draining instance it holds, none
for the others. Per tick: the records and the hash are read, the engines are asked together,
one transaction writes.

A drain is the scheduler's write; a switch waits for a reading taken after it began. So
hostd follows its host's notifications and reads at once when one of its instances starts
draining, then every `DRAINING_INTERVAL_S` while any drains, and says on the host's channel
that a draining engine's reading was written, so the scheduler re-plans without waiting for
its next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from pydantic import ValidationError

from capycommon.engines.control import Load, Timeouts
from capycommon.errors import CapyError
from capycommon.service import REDIS_ERRORS, wait_either, wait_event
from capycommon.state import load, notify
from capycommon.state.instances import InstanceRecord, InstanceState
from capycommon.state.load import EngineLoad
from capycommon.state.notify import Notification
from capyctl_hostd.engines import Engine
from capyctl_hostd.runner import Runner

log = logging.getLogger(__name__)
S = InstanceState
INTERVAL_S = 1.0
# While an instance drains, the scheduler waits for a reading taken after the drain began to
# park or stop it (a switch waits on that): read more often then.
DRAINING_INTERVAL_S = 0.2
SERVING = (S.READY, S.DRAINING)
# An engine slower than a tick to answer keeps its previous entry; the next tick asks again.
TIMEOUTS = Timeouts(metrics=INTERVAL_S)


async def publish(runner: Runner, stop: asyncio.Event, interval_s: float = INTERVAL_S) -> None:
    """Every `interval_s` until `stop`, and at once when a drain begins; a tick Redis
    interrupts is retried at the next."""
    drained = asyncio.Event()
    follower = asyncio.create_task(follow_drains(runner, drained, stop))
    try:
        while not stop.is_set():
            drained.clear()
            draining = False
            with contextlib.suppress(*REDIS_ERRORS):  # back at the next turn, or hostd exits
                draining = await tick(runner)
            wait = min(interval_s, DRAINING_INTERVAL_S) if draining else interval_s
            await wait_either(drained, stop, wait)
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower


async def follow_drains(runner: Runner, drained: asyncio.Event, stop: asyncio.Event) -> None:
    """Set `drained` whenever one of the instances hostd holds is notified as draining."""
    channels = [name for name, host in notify.channels([runner.host]).items() if host]
    while not stop.is_set():
        try:
            async with notify.subscribed(runner.client, channels) as pubsub:
                drained.set()  # (re)subscribed: a drain may have begun meanwhile
                while not stop.is_set():
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                    if message is not None and await _drains(runner, message["data"]):
                        drained.set()
        except REDIS_ERRORS:
            await wait_event(stop, 1.0)


async def _drains(runner: Runner, data: bytes | str) -> bool:
    """Whether a notification says an instance hostd holds may have begun to drain."""
    try:
        note = Notification.model_validate_json(data)
    except ValidationError:
        return False
    if note.kind != "instance" or note.id not in runner.engines:
        return False
    deployment, _, index = note.id.rpartition(":")
    record = await runner.store.get(deployment, int(index))
    return record is not None and record.state == S.DRAINING


async def tick(runner: Runner) -> bool:
    """Read every serving engine's load and bring the host's load hash up to date; True when
    an instance is draining.

    An entry written for an instance that stopped serving while its engine was asked lives
    until the next tick removes it; its generation tells a reader which launch it was. When
    a draining instance's entry is written, the host's channel says so.
    """
    held = dict(runner.engines)
    records, published = await _read(runner, list(held))
    serving = [r for r in records if r.state in SERVING]
    reads = await asyncio.gather(*(_load(held[r.member]) for r in serving))
    entries = {
        record.member: entry(record, found, read_at, published.get(record.member))
        for record, (found, read_at) in zip(serving, reads, strict=True)
        if found is not None and record.member in runner.engines
    }
    serving_members = {record.member for record in serving}
    gone = [member for member in published if member not in serving_members]
    draining = {record.member for record in serving if record.state == S.DRAINING}
    if not entries and not gone:
        return bool(draining)
    await load.publish_loads(
        runner.client, runner.host, entries, gone, notify=bool(draining & set(entries))
    )
    return bool(draining)


def entry(
    record: InstanceRecord, now: Load, read_at: float, previous: EngineLoad | None
) -> EngineLoad:
    """The entry for one reading: active now if anything runs or waits, else as last seen
    (for this launch), else since the instance entered its state."""
    if now.running + now.waiting > 0:
        last_active = read_at
    elif previous is not None and previous.generation == record.generation:
        last_active = previous.last_active_at
    else:
        last_active = record.since
    return EngineLoad(
        generation=record.generation,
        running=now.running,
        waiting=now.waiting,
        last_active_at=last_active,
        read_at=read_at,
    )


async def _read(
    runner: Runner, members: list[str]
) -> tuple[list[InstanceRecord], dict[str, EngineLoad]]:
    """The records of these members, and the load hash as published."""
    records = await runner.store.get_many(members)
    return records, await load.aread_loads(runner.client, runner.host)


async def _load(engine: Engine) -> tuple[Load | None, float]:
    """The engine's load (None when it cannot be read now) and when it was read."""
    control = engine.control(TIMEOUTS)
    try:
        return await control.load(), time.time()
    except (CapyError, ValueError) as exc:  # ValueError: a metric that is not a number
        log.debug("no load from the engine on port %s: %s", engine.spec.port, exc)
        return None, time.time()
    finally:
        await control.aclose()
