"""Admission: a place on a ready instance, or a bounded wait while the scheduler wakes or
starts it; and what happens to the place of a request cut short.

A request takes one of the instance's 32 places through the admission script (which also
checks the instance is ready at the generation the router saw), or goes through on a spare
place its worker kept from the request before, while the worker's table shows the instance
ready at that generation (a drain waits for spares: `capycommon.state.places`). When none is
free, or nothing is ready, it waits in its deployment's queue (64 by default, 256 in all; beyond
that 429 queue_full at once, the wake still asked for). The first waiter of a wave sends one
demand; everyone waiting is woken together when the deployment changes.

A cut request (client gone, deadline passed) keeps its place until it settles, as the 0.1.7
notes say: one the engine had started answering settles when the engine reads idle; one cut
before any answer only at the instance's next stop (a new generation starts its places from
zero). When such requests hold every place, the instance is restarted. On SGLang, hostd also
aborts the request by id; where the engine shows the request's end (SGLang 0.5.22), hostd
reports it and the request settles then: answered or not, if the engine held it; answered
only, if it did not (one cut before any answer may still reach the engine). A decision
request has no id SGLang knows, and SGLang runs it to its end: it settles at the next stop
there; llama.cpp drops it with its connection, so it settles when the engine reads idle.

A request that found its model not ready may ask to be told how its wait goes
(`capyctl_router.progress`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import defaultdict
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from capycommon.domain.commands import Abort
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.places import owner_id
from capycommon.engines.families import LOAD_UNREAD
from capycommon.errors import (
    ActivationFailed,
    CapyError,
    DeploymentInactive,
    DeploymentStopped,
    QueueFull,
    RedisUnreachable,
    Unavailable,
    UnknownModel,
)
from capycommon.service import REDIS_ERRORS, REDIS_OUTAGE, wait_any, wait_event
from capycommon.state import heartbeats, places
from capycommon.state.places import PlaceBook
from capycommon.state.stores import State
from capyctl_router.metrics import Metrics
from capyctl_router.progress import Progress
from capyctl_router.table import Table, Target

log = logging.getLogger(__name__)
T = TypeVar("T")
# A wave re-asks for its deployment this often while requests still wait.
DEMAND_EVERY_S = 5.0
# Cut requests are checked for settlement this often.
SETTLE_EVERY_S = 0.25
# Whether cut requests hold every place of a deployment is read at most this often, however
# many requests find its places taken.
ALL_CUT_EVERY_S = 1.0
# A request whose admission meets a Redis failure tries again this often, for this long in
# all, then gets 503 redis_unreachable (with Retry-After).
REDIS_RETRY_EVERY_S = 0.1
REDIS_RETRY_S = 2.0
# This router writes its own count of places back this often (`PlaceBook.keep`), and at the
# next settlement round after any Redis failure.
KEEP_EVERY_S = heartbeats.INTERVAL_S


@dataclass(frozen=True)
class UnsettledCut:
    """A cut request whose place waits for it to settle."""

    deployment: str
    generation: int
    host: str
    settles: str  # the places field it counts in: settle_when_idle or settle_at_stop
    at: float
    reported: bool  # hostd was asked to abort it and may report its end


@dataclass(frozen=True)
class Limits:
    running: int = places.LIMIT
    # The router's workers, who share the places (`capycommon.state.places`).
    workers: int = 1
    waiting_per_deployment: int = 64
    waiting_total: int = 256
    request_deadline_s: float = 1800.0
    stream_idle_s: float = 120.0


@dataclass
class Dispatcher:
    state: State
    table: Table
    metrics: Metrics
    limits: Limits = field(default_factory=Limits)
    _demanded: dict[str, float] = field(default_factory=dict)
    # The wall-clock time of each deployment's last demand, to compare with a refusal's.
    _demanded_at: dict[str, float] = field(default_factory=dict)
    # Cut requests by id until they settle (a stop settles those of its generation).
    _cuts: dict[str, UnsettledCut] = field(default_factory=dict)
    # host -> the cursor in its stream of request ends (`capycommon.state.settlement`).
    _ends_after: dict[str, str] = field(default_factory=dict)
    # When each deployment's places were last read for cut requests holding them all.
    _all_cut_read: dict[str, float] = field(default_factory=dict)
    # Who holds this router's places (`capycommon.state.places`): one id per process.
    owner: str = field(default_factory=lambda: owner_id("router", os.getpid()))
    # When this router last wrote its count of places back, and whether Redis failed since.
    _kept: float = -KEEP_EVERY_S
    _redis_failed: bool = False

    def __post_init__(self) -> None:
        self.book = PlaceBook(self.state.client, self.owner, self.limits.workers)
        # Set when the settle loop has something new to look at: a cut, or a first spare.
        self._sooner = asyncio.Event()
        # Spares given back when their instance is no longer ready (`_changed`), until done.
        self._drops: set[asyncio.Task[None]] = set()
        self.table.on_change = self._changed
        # A change cut short (a client hung up while its script was on its way) is put
        # right by a keep at once, not at the next one due.
        self.book.on_unsure = self._sooner.set

    def deadline_of(self, record: DeploymentRecord) -> float:
        """How long a request for it may wait for its first output."""
        return record.document.request_deadline or self.limits.request_deadline_s

    async def acquire(
        self, record: DeploymentRecord, deadline: float, progress: Progress | None = None
    ) -> Target:
        """A place on the deployment's ready instance, waiting for one until `deadline`. The
        record is the one the request was routed by; while it waits, the table's newer ones
        decide (a stop, a failure, a refusal). Once it found its model not ready, `progress`
        is told how the wait goes."""
        name = record.name
        queued = False
        cold = False  # it found its model not ready
        started = time.monotonic()
        joined = time.time()
        failing: float | None = None  # since when Redis fails this request
        reason = ""  # what Redis's failure was (not the retries' own deadline, which ends them)
        try:
            while True:
                self._check_open(name, joined)
                try:
                    target = await _bounded(self._try_place(name), failing)
                    if target is None and not queued:
                        await _bounded(self._join(name), failing)
                        queued = True
                    failing = None
                except (*REDIS_ERRORS, TimeoutError) as exc:
                    self._failed(exc)
                    if type(exc) is not TimeoutError or not reason:
                        reason = str(exc) or type(exc).__name__
                    failing = time.monotonic() if failing is None else failing
                    if time.monotonic() - failing >= REDIS_RETRY_S:
                        raise RedisUnreachable(
                            f"the router cannot use Redis ({reason}); retry shortly"
                        ) from None
                    await asyncio.sleep(REDIS_RETRY_EVERY_S)
                    continue
                if target is not None:
                    if cold:
                        self.metrics.ready_wait(name, time.monotonic() - started)
                    return target
                cold = cold or self.table.target(name) is None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Unavailable(
                        f"{name!r} did not become ready within the request deadline "
                        f"({self.deadline_of(record):.0f}s); retry shortly",
                    )
                wait = 1.0
                if cold and progress is not None:
                    await progress.tell(name, self.table, self.state, self._failed)
                    wait = max(0.0, progress.due_in())
                changed = self.table.changed(name)
                await wait_event(changed, min(remaining, wait))
        finally:
            if queued:
                await self._leave(name)
            self.metrics.queue_wait(name, time.monotonic() - started)

    async def _try_place(self, name: str) -> Target | None:
        """A place on the deployment's ready instance if one is free; else its start, wake or
        restart is asked for."""
        target = self.table.target(name)
        if target is None:
            await self._demand(name)
            REDIS_OUTAGE.ok()
            return None
        if self.book.use_spare(name, target.generation):
            return replace(target, spare=True)
        taken = await self.book.take(target.host, name, target.generation, self.limits.running)
        REDIS_OUTAGE.ok()
        if taken == 1:
            self._demanded.pop(name, None)  # the wave is served: the next asks anew
            return target
        if taken == 0:
            await self._all_places_cut(name, target)
        return None

    async def _join(self, name: str) -> None:
        """Wait in the deployment's queue; QueueFull if it, or the router's, is full (the
        workers' waiting requests together)."""
        limits = self.limits
        if not await self.book.join(name, limits.waiting_per_deployment, limits.waiting_total):
            self.metrics.queue_full(name)
            raise QueueFull(
                f"the queue for {name!r} is full ({limits.waiting_per_deployment} waiting); "
                "retry shortly",
            )
        REDIS_OUTAGE.ok()
        self.metrics.set_waiting(name, self.book.waiting[name])

    async def _leave(self, name: str) -> None:
        try:
            await self.book.leave(name)
        except REDIS_ERRORS as exc:
            self._failed(exc)  # left here: the next keep says so in Redis
        self.metrics.set_waiting(name, self.book.waiting[name])

    def _failed(self, exc: BaseException) -> None:
        """Redis failed: said once per outage, and this router's count of places is written
        back as soon as Redis answers again."""
        REDIS_OUTAGE.failed(exc)
        self._redis_failed = True

    def _check_open(self, name: str, joined: float) -> None:
        record = self.table.records.get(name)
        if record is None or record.deleting:
            raise UnknownModel(f"the model {name!r} is gone")
        refusal = record.refusal
        if refusal is not None and refusal.at >= joined:
            # The scheduler answered a demand made while this request waited: it cannot be met.
            raise CapyError(refusal.message, code=refusal.code)
        if record.stopped:
            raise DeploymentStopped(
                f"deployment {name!r} was stopped by an operator; start it with "
                f"capyctl start deployment {name}",
            )
        if record.attempts.failed:
            raise ActivationFailed(
                f"deployment {name!r} could not start: {record.attempts.last_error}; an "
                f"operator start tries again (capyctl start deployment {name})",
            )
        if record.activation == "explicit" and record.wanted != "ready":
            raise DeploymentInactive(
                f"deployment {name!r} starts only on an operator start (activation: explicit)",
            )

    async def _demand(self, name: str, restart: int | None = None) -> None:
        """One demand per wave, re-sent every few seconds while it waits; a wave whose demand
        the scheduler refused is over, so the next request asks anew."""
        now = time.monotonic()
        record = self.table.records.get(name)
        refusal = record.refusal if record is not None else None
        answered = refusal is not None and refusal.at >= self._demanded_at.get(name, 0.0)
        recent = now - self._demanded.get(name, -DEMAND_EVERY_S) < DEMAND_EVERY_S
        if restart is None and recent and not answered:
            return
        self._demanded[name] = now
        self._demanded_at[name] = time.time()
        await self.state.demands.ask(name, "router", restart=restart)

    async def _all_places_cut(self, name: str, target: Target) -> None:
        """Every place held by requests cut before any answer: restart the instance."""
        now = time.monotonic()
        if now - self._all_cut_read.get(name, -ALL_CUT_EVERY_S) < ALL_CUT_EVERY_S:
            return
        self._all_cut_read[name] = now
        found = await self.state.places.get(name)
        if found.generation == target.generation and found.settle_at_stop >= self.limits.running:
            log.warning(
                "%s: cancelled requests hold all %d places; asking for a restart",
                name,
                self.limits.running,
            )
            await self._demand(name, restart=target.generation)

    async def release(self, target: Target) -> None:
        """A request ended: its place is kept as a spare while its instance stays ready, or
        given back."""
        name, generation = target.deployment, target.generation
        first = not self.book.free
        try:
            await self.book.end(
                name, generation, target.spare, keep=self.table.ready_at(name, generation)
            )
        except REDIS_ERRORS as exc:
            self._failed(exc)  # counted here: the next keep writes it in Redis
        if first and self.book.free:
            self._sooner.set()  # their time unused is watched from now
        self.table.wake(name)

    def _changed(self, name: str) -> None:
        """The table changed `name`: spares kept for an instance no longer ready at their
        generation are given back at once (its drain waits for them)."""
        generation = self.book.free_generation(name)
        if generation is None or self.table.ready_at(name, generation):
            return
        drop = asyncio.ensure_future(self._drop_spares(name))
        self._drops.add(drop)
        drop.add_done_callback(self._drops.discard)

    async def _drop_spares(self, name: str) -> None:
        try:
            await self.book.drop_spares(name, announce=True)
        except REDIS_ERRORS as exc:
            self._failed(exc)  # dropped here: the next keep writes it in Redis

    async def cut(
        self, target: Target, request_id: str, answered: bool, decision: bool = False
    ) -> None:
        """A request cut short: close its account as the 0.1.7 notes say; on SGLang, also
        have hostd abort it by id (and report its end where the engine shows it). A decision
        request has no id SGLang knows: it runs to its end there, so it settles at the next
        stop; llama.cpp drops it with its connection, so it settles once the engine reads
        idle. On an engine whose load CapyCTL does not read (TensorFold, a custom engine),
        every cut request settles at the next stop."""
        name = target.deployment
        self.metrics.cancelled(name)
        if decision:
            at_stop = target.family == "sglang"
            settles = "settle_at_stop" if at_stop else "settle_when_idle"
            reported = False
        else:
            # No idle reading ever comes from an engine whose load is not read: a stop settles.
            idle_settles = answered and target.family not in LOAD_UNREAD
            settles = "settle_when_idle" if idle_settles else "settle_at_stop"
            reported = target.family == "sglang"
        log.info("request %s on %s cut; it counts as %s", request_id, name, settles)
        if settles == "settle_when_idle" or reported:
            self._cuts[request_id] = UnsettledCut(
                name, target.generation, target.host, settles, time.time(), reported
            )
            self._sooner.set()
        try:
            await self.book.cut(name, target.generation, settles, spare=target.spare)
            if reported:
                await self._abort(target, request_id)
        except REDIS_ERRORS as exc:
            self._failed(exc)  # counted here: the next keep counts it in Redis

    async def _abort(self, target: Target, request_id: str) -> None:
        """Have hostd abort the request in its engine and report its end."""
        if target.host not in self._ends_after:  # before the abort: no end is missed
            self._ends_after[target.host] = await self.state.settlement.cursor(target.host)
        abort = Abort(
            deployment=target.deployment, generation=target.generation, request_id=request_id
        )
        await self.state.commands.send(target.host, abort)

    async def settle(self, stop: asyncio.Event) -> None:
        """Keep this router's places true: give back those of cut requests as they settle
        (when hostd reports the end of one it aborted, or when the engine reads idle, a
        reading taken after the cut) and spares left unused for SPARE_IDLE_S, and write its
        own count back every few seconds, and once Redis answers again after a failure."""
        while not stop.is_set():
            await wait_any(stop, self._sooner, timeout=self._settle_wait())
            self._sooner.clear()
            if stop.is_set():
                return
            try:
                if self._cuts:
                    await self._settle_once()
                await self.book.drop_idle_spares()
                await self._keep()
            except REDIS_ERRORS as exc:
                self._failed(exc)

    def _settle_wait(self) -> float:
        """Cut requests, or a Redis failure, are looked at every SETTLE_EVERY_S; otherwise
        nothing is due before the next keep, or a new cut (`cut` wakes the loop): an idle
        router wakes a few times less a second."""
        if self._cuts or self._redis_failed:
            return SETTLE_EVERY_S
        due = self._kept + KEEP_EVERY_S
        spares = self.book.spares_due()
        if spares is not None:
            due = min(due, spares)
        return min(KEEP_EVERY_S, max(SETTLE_EVERY_S, due - time.monotonic()))

    async def _keep(self) -> None:
        now = time.monotonic()
        if not (self._redis_failed or self.book.unsure) and now - self._kept < KEEP_EVERY_S:
            return
        self._redis_failed = False
        if await self.book.keep(self.table.records):
            self._kept = now
            REDIS_OUTAGE.ok()
        else:
            self._redis_failed = True  # requests kept their places busy: soon again

    async def _settle_once(self) -> None:
        for request_id, cut in list(self._cuts.items()):
            current = self.table.instances.get(cut.deployment)
            if current is None or current.generation != cut.generation:
                del self._cuts[request_id]  # a stop settled it
        await self._settle_reported()
        await self._settle_idle()

    async def _settle_reported(self) -> None:
        """The requests hostd reports ended: answered ones settle; one cut before any answer
        settles only if the engine held it, else it may still arrive and waits for a stop."""
        for host in {cut.host for cut in self._cuts.values() if cut.reported}:
            if host not in self._ends_after:  # the cut's own read of the cursor failed
                self._ends_after[host] = await self.state.settlement.cursor(host)
            after, ends = await self.state.settlement.read_after(host, self._ends_after[host])
            for end in ends:
                cut = self._cuts.get(end.request_id)
                if cut is None or (cut.deployment, cut.generation) != (
                    end.deployment,
                    end.generation,
                ):
                    continue
                if cut.settles == "settle_when_idle" or end.held:
                    await self.book.give(cut.deployment, cut.generation, cut=cut.settles)
                    self.table.wake(cut.deployment)
                    log.info(
                        "request %s on %s ended in the engine; settled",
                        end.request_id,
                        cut.deployment,
                    )
                del self._cuts[end.request_id]
            self._ends_after[host] = after

    async def _settle_idle(self) -> None:
        """Requests the engine had answered settle once it reads idle after their cut."""
        waiting: dict[tuple[str, int, str], list[tuple[str, UnsettledCut]]] = defaultdict(list)
        for request_id, cut in self._cuts.items():
            if cut.settles == "settle_when_idle":
                waiting[(cut.deployment, cut.generation, cut.host)].append((request_id, cut))
        for (name, generation, host), cuts in waiting.items():
            found = (await self.state.loads.get(host)).get(f"{name}:0")
            if found is None or found.generation != generation:
                continue
            if not found.busy:
                settled = [request_id for request_id, cut in cuts if found.read_at > cut.at]
                if settled:
                    await self.book.give(name, generation, len(settled), cut="settle_when_idle")
                    for request_id in settled:
                        del self._cuts[request_id]
                    self.table.wake(name)


async def _bounded(work: Awaitable[T], failing: float | None) -> T:
    """`work`, within what is left of REDIS_RETRY_S after Redis began failing (`failing`)."""
    if failing is None:
        return await work
    async with asyncio.timeout(max(0.0, failing + REDIS_RETRY_S - time.monotonic())):
        return await work
