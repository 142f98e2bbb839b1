"""Publishing each serving engine's load: its running and waiting requests, once a second.

The scheduler needs to know which engines are busy (never switch them out) and which have
been idle longest, without talking to engines itself. hostd already holds each engine's
address and key, so it reads the engine's own metrics and keeps the host's load hash
(`capycommon.state.load`) current: an entry per ready or draining instance it holds, none
for the others. Per tick: the records and the hash are read, the engines are asked together,
one transaction writes.

A drain is the scheduler's write; a switch waits for a reading taken after it began, and
never picks a model its last reading found busy. So hostd follows its host's notifications
and reads at once when one of its instances changes (starts draining, becomes ready, stops
serving), then every `SOON_S` while any drains or last read busy, and says on the host's
channel that a draining engine's reading was written, or that a busy engine now reads idle,
so the scheduler re-plans without waiting for its next tick: a switch asked for just after a
model's last request waits a fifth of a second for its idle reading, not a second. With no
engine serving there is nothing to read: it waits for the next change (at most `QUIET_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from capycommon.domain.hosts import EngineLoad
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.notifications import announces
from capycommon.engines.control import Load, Timeouts
from capycommon.errors import CapyError
from capycommon.service import REDIS_ERRORS, wait_any, wait_event
from capycommon.state import notify
from capycommon.tasks import beside
from capyctl_hostd.engines import Engine
from capyctl_hostd.runner import Runner

log = logging.getLogger(__name__)
S = InstanceState
INTERVAL_S = 1.0
# While an instance drains, the scheduler waits for a reading taken after the drain began to
# park or stop it, and while one reads busy, a switch may wait for it to read idle: read more
# often then.
SOON_S = 0.2
# With no engine serving, the longest it waits for an instance's change; a bound on what a
# lost notification could leave stale.
QUIET_S = 30.0
SERVING = (S.READY, S.DRAINING)
# An engine slower than a tick to answer keeps its previous entry; the next tick asks again.
TIMEOUTS = Timeouts(metrics=INTERVAL_S)


async def publish(runner: Runner, stop: asyncio.Event, interval_s: float = INTERVAL_S) -> None:
    """Every `interval_s` while an engine serves (every SOON_S while one drains or reads
    busy), and at once when an instance changes; a tick Redis interrupts is retried at the
    next."""
    changed = asyncio.Event()
    async with beside(follow_changes(runner, changed, stop), "hostd's instance notifications"):
        while not stop.is_set():
            changed.clear()
            serving, soon = True, False
            with contextlib.suppress(*REDIS_ERRORS):  # back at the next turn, or hostd exits
                serving, soon = await tick(runner)
            wait = QUIET_S if not serving else min(interval_s, SOON_S) if soon else interval_s
            await wait_any(changed, stop, timeout=wait)


async def follow_changes(runner: Runner, changed: asyncio.Event, stop: asyncio.Event) -> None:
    """Set `changed` whenever an instance of the host is announced (it may have begun to
    drain, to serve or to stop serving)."""
    channels = [name for name, host in notify.channels([runner.host]).items() if host]
    while not stop.is_set():
        try:
            async with notify.subscribed(runner.state.client, channels) as pubsub:
                changed.set()  # (re)subscribed: something may have changed meanwhile
                async for message in pubsub.listen():
                    if announces(message.get("data"), "instance"):  # not an engine load
                        changed.set()
        except REDIS_ERRORS:
            await wait_event(stop, 1.0)


async def tick(runner: Runner) -> tuple[bool, bool]:
    """Read every serving engine's load and bring the host's load hash up to date; whether an
    instance serves, and whether one is draining or reads busy (to be read again soon).

    An entry written for an instance that stopped serving while its engine was asked lives
    until the next tick removes it; its generation tells a reader which launch it was. When
    a draining instance's entry is written, or a busy one's now reads idle, the host's
    channel says so.
    """
    held = dict(runner.holdings.engines)
    records, published = await _read(runner, list(held))
    serving = [r for r in records if r.state in SERVING]
    reads = await asyncio.gather(*(_load(held[r.member]) for r in serving))
    entries = {
        record.member: entry(record, found, read_at, published.get(record.member))
        for record, (found, read_at) in zip(serving, reads, strict=True)
        if found is not None and record.member in runner.holdings.engines
    }
    serving_members = {record.member for record in serving}
    gone = [member for member in published if member not in serving_members]
    draining = {record.member for record in serving if record.state == S.DRAINING}
    soon = bool(draining) or any(found.busy for found in entries.values())
    if not entries and not gone:
        return bool(serving), soon
    settled = any(
        not found.busy and _was_busy(published.get(member), found.generation)
        for member, found in entries.items()
    )
    told = bool(draining & set(entries)) or settled
    await runner.state.loads.publish(runner.host, entries, gone, notify=told)
    return bool(serving), soon


def _was_busy(previous: EngineLoad | None, generation: int) -> bool:
    return previous is not None and previous.generation == generation and previous.busy


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
    """The records of these members, and the load hash as published (read together: a
    switch waits on the reading of its draining engine)."""
    return await asyncio.gather(runner.store.get_many(members), runner.state.loads.get(runner.host))


async def _load(engine: Engine) -> tuple[Load | None, float]:
    """The engine's load (None when it cannot be read now) and when it was read."""
    try:
        return await engine.control(TIMEOUTS).load(), time.time()
    except (CapyError, ValueError) as exc:  # ValueError: a metric that is not a number
        log.debug("no load from the engine on port %s: %s", engine.spec.port, exc)
        return None, time.time()
