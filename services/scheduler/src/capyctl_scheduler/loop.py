"""The planning loop: read the demands and hostd's refusals, take a snapshot, plan, apply.

It runs on every notification (a deployment, an instance or a demand changed), and at least
once a second while anything is under way (a demand, an effect in flight, an engine moving
between states: retries, deadlines, drains and fresh readings need the clock). When nothing
is (`policy.quiet_until`), it waits for a notification until the next idle step is due, and
at most QUIET_MAX_S. Everything it needs to resume is in Redis: a scheduler killed at any
moment picks up the same snapshot and plans again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field, replace

from pydantic import ValidationError
from redis.asyncio.client import PubSub
from redis.exceptions import ResponseError

from capycommon.domain.desired import Demand, DeploymentRecord
from capycommon.domain.memory import GpuMemory
from capycommon.service import REDIS_ERRORS, wait_any, wait_event
from capycommon.state import notify
from capycommon.state.desired import DEMAND_FIELD
from capycommon.state.stores import State
from capycommon.state.streams import Reader
from capycommon.tasks import beside, cancel_and_wait
from capyctl_scheduler.actuator import Actuator
from capyctl_scheduler.changes import Changes
from capyctl_scheduler.charges import gpu_memory
from capyctl_scheduler.leadership import RENEW_S, Leadership
from capyctl_scheduler.observe import Observer
from capyctl_scheduler.plantimes import Stopwatch, TickTimes
from capyctl_scheduler.policy import plan, quiet_until
from capyctl_scheduler.snapshot import Snapshot

log = logging.getLogger(__name__)
TICK_S = 1.0
# The longest a quiet loop waits without a notification: a bound on what a lost notification
# could delay, short enough to be no risk, long enough to cost nothing.
QUIET_MAX_S = 30.0
# Refusals are remembered this long: long enough for the plan to see them once.
REFUSAL_MEMORY_S = 600.0


@dataclass
class Demands:
    """Open demands from the durable stream. An entry is acknowledged only once its
    deployment is ready, stopped, failed or gone, or its deadline passed; a restarted
    scheduler reads the unacknowledged ones again."""

    state: State
    open: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    # deployment -> the generation a router asked to restart (its places all held by cuts).
    restarts: dict[str, int] = field(default_factory=dict)
    # Whether the group was made (once; again only when a read finds it gone).
    _ensured: bool = False
    _reader: Reader = field(init=False)

    def __post_init__(self) -> None:
        self._reader = Reader(self.state.demands.group())

    async def read(self) -> None:
        group = self._reader.group
        if not self._ensured:
            await group.ensure()
            self._ensured = True
        try:
            await self._read()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            await group.ensure()  # Redis lost the group (its data): make it, read it whole
            await self._read()

    async def _read(self) -> None:
        """First the entries delivered but never acknowledged, then all the new ones."""
        while True:
            new = not self._reader.in_history
            entries = await self._reader.read(count=1000)
            for entry_id, fields in entries:
                self._take(entry_id, fields)
            if new and len(entries) < 1000:
                return

    def _take(self, entry_id: str, fields: dict[bytes, bytes]) -> None:
        try:
            demand = Demand.model_validate_json(fields[DEMAND_FIELD.encode()])
        except (KeyError, ValidationError):
            log.error("dropping a malformed demand %s", entry_id)
            self.open.setdefault("", []).append((entry_id, 0.0))
            return
        self.open.setdefault(demand.deployment, []).append((entry_id, demand.at))
        if demand.restart is not None:
            self.restarts[demand.deployment] = demand.restart

    def oldest(self) -> dict[str, float]:
        return {name: min(at for _, at in found) for name, found in self.open.items() if name}

    async def ack(self, deployment: str) -> None:
        self.restarts.pop(deployment, None)
        found = self.open.pop(deployment, [])
        if found:
            await self._reader.ack(*(entry for entry, _ in found))

    async def expire(
        self, deployments: Mapping[str, DeploymentRecord], now: float, default_deadline: float
    ) -> None:
        """Drop demands older than their deployment's request deadline, and those for a
        deployment that does not exist."""
        for name in list(self.open):
            record = deployments.get(name)
            if record is None:
                await self.ack(name)
                continue
            deadline = record.document.request_deadline or default_deadline
            stale = [entry for entry, at in self.open[name] if now - at > deadline]
            if stale:
                kept = [(e, at) for e, at in self.open[name] if e not in stale]
                if kept:
                    self.open[name] = kept
                else:
                    del self.open[name]
                await self._reader.ack(*stale)


@dataclass
class Refusals:
    """Commands hostd refused, from the hosts' event streams: (deployment, generation) -> when
    Redis took the refusal, in ms (its stream entry's time, on the scheduler's own machine)."""

    state: State
    hosts: list[str]
    seen: dict[tuple[str, int], int] = field(default_factory=dict)
    _cursors: dict[str, str] = field(default_factory=dict)

    async def read(self) -> None:
        if not self.hosts:
            return
        start = f"{int((time.time() - REFUSAL_MEMORY_S) * 1000)}-0"
        cursors = {host: self._cursors.get(host, start) for host in self.hosts}
        for host, entry_id, event in await self.state.events.after(cursors, count=1000):
            self._cursors[host] = entry_id
            if event is not None and event.kind == "refused":
                self.seen[(event.deployment, event.generation)] = _entry_ms(entry_id)
        oldest = (time.time() - REFUSAL_MEMORY_S) * 1000
        self.seen = {k: at for k, at in self.seen.items() if at >= oldest}

    def answering(self, deployments: Mapping[str, DeploymentRecord]) -> frozenset[tuple[str, int]]:
        """The refusals of the effects in flight: each came after its effect's command was
        sent. An earlier refusal of the same generation is another command's, as that of a
        deployment deleted and declared again under the same name (its generations start
        again from 1): a launch hostd is about to carry out is not taken for refused."""
        found = set()
        for name, record in deployments.items():
            effect = record.inflight
            if effect is None:
                continue
            at = self.seen.get((name, effect.generation))
            if at is not None and at >= int(effect.sent_at * 1000):
                found.add((name, effect.generation))
        return frozenset(found)


def _entry_ms(entry_id: str) -> int:
    """When Redis took a stream entry, in ms since the epoch (the first part of its id)."""
    return int(entry_id.split("-", 1)[0])


@dataclass
class Scheduler:
    state: State
    observer: Observer
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    last: Snapshot | None = None
    # When the last plan may next change by the clock alone; None while anything is under way.
    quiet_until: float | None = None
    # The summary of the GPUs' charges last written for the router's metrics.
    gpu_memory: GpuMemory | None = None
    # The notifications heard, for the status page's live updates.
    changes: Changes = field(default_factory=Changes)
    # The scheduler lease: only its holder plans (None: this scheduler plans alone, as in
    # tests of the plan).
    leadership: Leadership | None = None
    # The epoch of the lease this scheduler's current term began under.
    _term: int | None = None
    # What its ticks cost, written for `capyctl status` while it leads.
    times: TickTimes = field(default_factory=TickTimes)

    def __post_init__(self) -> None:
        self._hosts_changed = asyncio.Event()
        self._begin_term(None)

    def _begin_term(self, epoch: int | None) -> None:
        """Start planning from Redis alone: the demands a previous leader read and left
        unacknowledged are read again, and nothing of an earlier term is remembered."""
        self._term = epoch
        self.demands = Demands(self.state)
        self.refusals = Refusals(self.state, sorted(self.observer.hosts))
        self.actuator = Actuator(self.state, self.demands.ack, epoch)
        self.gpu_memory = None

    def leads(self) -> bool:
        """Whether this scheduler plans now: it holds the lease (or runs without one); a
        lease taken anew begins a term."""
        lead = self.leadership
        if lead is None:
            return True
        if not lead.held:
            return False
        if lead.epoch != self._term:
            self._begin_term(lead.epoch)
        return True

    async def tick(self) -> Snapshot:
        # Independent reads, sent together: a wake or a switch waits on several ticks.
        await asyncio.gather(self.demands.read(), self.refusals.read())
        snapshot = await self.observer.snapshot(
            self.demands.oldest(), restarts=self.demands.restarts
        )
        snapshot = replace(snapshot, refused=self.refusals.answering(snapshot.deployments))
        if sorted(snapshot.hosts) != self.refusals.hosts:
            # A host joined: follow its events and its channel too.
            self.refusals.hosts = sorted(snapshot.hosts)
            self._hosts_changed.set()
        await self.demands.expire(
            snapshot.deployments, snapshot.now, snapshot.tunables.demand_deadline_s
        )
        actions = plan(snapshot)
        if self.leadership is not None and not self.leadership.held:
            return snapshot  # the lease ran out while this tick read and planned
        await self.actuator.apply(snapshot, actions)
        self.last = snapshot
        summary = gpu_memory(snapshot)
        if summary != self.gpu_memory:  # written when it changed, and once at start
            await self.state.gpu_memory.publish(summary)
            self.gpu_memory = summary
        await self.state.refusals.send()  # the values this tick's reads refused, counted
        if self.demands.open or self.observer.describing:
            self.quiet_until = None  # a malformed demand to drop, a host to ask again
        else:
            self.quiet_until = quiet_until(snapshot, actions)
        return snapshot

    def pause(self, now: float) -> float:
        """How long the loop may wait for a notification before it plans again."""
        if self.quiet_until is None:
            return TICK_S
        # A little past the step, so the plan sees it due.
        return min(QUIET_MAX_S, max(TICK_S, self.quiet_until - now + 0.01))

    async def run(self, stop: asyncio.Event) -> None:
        try:
            async with (
                beside(self._listen(stop), "the scheduler's notifications"),
                self._leading(stop),
            ):
                while not stop.is_set():
                    if not self.leads():
                        await self._follow(stop)
                        continue
                    try:
                        watch = Stopwatch()
                        await self.tick()
                        await self._timed(*watch.read())
                    except REDIS_ERRORS as exc:
                        log.warning("planning loop paused: Redis: %s", exc)
                        await wait_event(stop, 1.0)
                        continue
                    # A notification that came during the tick has set `wake`: plan again at
                    # once, with everything it and any others told (a burst costs one tick).
                    # The stop too: a quiet loop waits up to QUIET_MAX_S, past supervisord's
                    # patience with a stopping service.
                    await wait_any(self.wake, stop, timeout=self.pause(time.time()))
                    self.wake.clear()
        finally:
            self.changes.close()

    async def _timed(self, wall_s: float, cpu_s: float) -> None:
        self.times.add(wall_s, cpu_s)
        now = time.time()
        if self.times.due(now):
            server = "local" if self.leadership is None else self.leadership.server
            await self.state.leader.publish_plan_times(self.times.summary(server, now))

    def _leading(self, stop: asyncio.Event) -> AbstractAsyncContextManager[object]:
        if self.leadership is None:
            return nullcontext()
        return beside(self.leadership.run(stop), "the scheduler lease")

    async def _follow(self, stop: asyncio.Event) -> None:
        """Wait while another scheduler leads, until this one takes the lease."""
        assert self.leadership is not None
        await wait_any(self.leadership.changed, stop, timeout=RENEW_S)
        self.leadership.changed.clear()

    async def _listen(self, stop: asyncio.Event) -> None:
        """Every notification of the control plane or of a host wakes the loop; the
        subscription is made anew when the hosts change."""
        while not stop.is_set():
            self._hosts_changed.clear()
            channels = notify.channels(self.refusals.hosts)
            try:
                async with notify.subscribed(self.state.client, channels) as pubsub:
                    self.wake.set()  # re-sync on (re)connect: messages may have been lost
                    self.changes.note()
                    reading = asyncio.ensure_future(self._read(pubsub))
                    changed = asyncio.ensure_future(self._hosts_changed.wait())
                    try:
                        await asyncio.wait([reading, changed], return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        await cancel_and_wait(reading, changed)
                    if reading.done() and not reading.cancelled():
                        reading.result()  # raises what ended the read (Redis: try again)
            except REDIS_ERRORS:
                await wait_event(stop, 1.0)

    async def _read(self, pubsub: PubSub) -> None:
        async for message in pubsub.listen():
            if message.get("type") == "message":
                self.wake.set()
                self.changes.note()
