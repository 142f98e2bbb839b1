"""The simulated scheduler: requests wait for a slot, then produce their planned tokens at the
behaviour's speed, until they finish, are aborted, or the engine stops producing.

Two switches model every way an engine holds work: `admitting` (waiting requests may take a
slot) and `producing` (running requests get tokens). Sleep closes both; the `hang` fault
closes only `producing`, so requests stay running and nothing comes.

Tokens are paced by the clock, not by one sleep each: every token whose time has come is
produced at once, and the answer takes them as one batch (one write of a stream). A sleep
shorter than the event loop's tick would otherwise last a whole tick (about 1 ms) and cost
a timer and a task per token, so a fast pace was never reached. With `instant` the whole
answer is produced as soon as the request is admitted.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal

from enginesim.behaviour import GARBAGE_ANSWER, Behaviour
from enginesim.metrics import Histogram

TokenKind = Literal["reasoning", "content", "tool_name", "tool_args"]
Finish = Literal["stop", "length", "tool_calls", "abort", "error"]

_serial = itertools.count()


@dataclass(frozen=True)
class Token:
    kind: TokenKind
    text: str


@dataclass(eq=False)
class Work:
    """One request inside the engine."""

    rid: str
    prompt_tokens: int
    plan: list[Token]
    planned_finish: Finish
    produced: list[Token] = field(default_factory=list)
    finish: Finish | None = None
    error: str | None = None  # why it finished with "error"
    # A decision: no tokens, and this long in the engine (its prefill) instead of the
    # behaviour's prefill_seconds.
    prefill_seconds: float | None = None
    # SGLang's decisions: a hang-up does not stop it, and no abort by its rid reaches it.
    runs_to_end: bool = False
    key: int = field(default_factory=lambda: next(_serial))
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    # Produced and not yet taken by the answer; `ended` once nothing more will come.
    pending: list[Token] = field(default_factory=list)
    ended: bool = False
    more: asyncio.Event = field(default_factory=asyncio.Event)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    scheduled: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def completion_tokens(self) -> int:
        return len(self.produced)

    async def batches(self) -> AsyncIterator[list[Token]]:
        """The tokens as they come, those produced together in one list; ends when the work
        finishes for any reason."""
        while True:
            if not self.pending and not self.ended:
                self.more.clear()
                await self.more.wait()
            if self.pending:
                taken, self.pending = self.pending, []
                yield taken
            elif self.ended:
                return


@dataclass
class Stats:
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    aborted: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    queue_time: Histogram = field(default_factory=Histogram)


class Engine:
    def __init__(self, behaviour: Behaviour, slots: int, on_fatal: Callable[[str], None]) -> None:
        self.behaviour = behaviour
        self.slots = max(1, slots)
        self.on_fatal = on_fatal
        self.running: dict[int, Work] = {}
        self.waiting: dict[int, Work] = {}
        self.admitting = True
        self.producing = asyncio.Event()
        if not behaviour.faults.hang:
            self.producing.set()
        self.stats = Stats()
        self.tokens_total = 0
        self.weights_stale = False  # woken from a discard without reloading the weights
        self._woken = False
        self.on_idle: Callable[[], None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # What the model says ------------------------------------------------------------

    def answer(self) -> str:
        garbage = self._woken and self.behaviour.faults.garbage_after_wake
        return GARBAGE_ANSWER if garbage or self.weights_stale else self.behaviour.answer

    def woken(self) -> None:
        self._woken = True

    # Admission and the run of one request ------------------------------------------------

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def submit(self, work: Work) -> None:
        self.stats.requests += 1
        self.waiting[work.key] = work
        self._schedule()
        if self._answers_at_once(work):
            # Nothing to wait for: the answer is made here, with no task and no turn of the
            # event loop of its own.
            for token in work.plan:
                if work.aborted.is_set():
                    break
                self._emit(work, token)
            if not work.aborted.is_set():
                self._finish(work, work.planned_finish)
            self._ended(work)
            return
        task = asyncio.create_task(self._run(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _answers_at_once(self, work: Work) -> bool:
        behaviour = self.behaviour
        return (
            behaviour.instant
            and self._prefill(work) == 0
            and work.scheduled.is_set()
            and self.producing.is_set()
        )

    def _schedule(self) -> None:
        while self.admitting and self.waiting and len(self.running) < self.slots:
            key, work = next(iter(self.waiting.items()))
            del self.waiting[key]
            self.running[key] = work
            self.stats.prompt_tokens += work.prompt_tokens
            self.stats.queue_time.observe(time.monotonic() - work.created)
            work.scheduled.set()

    async def _run(self, work: Work) -> None:
        try:
            if not await self._until(work.scheduled, work):
                return
            prefill = self._prefill(work)
            if prefill > 0 and await _within(work, prefill):
                return
            if await self._produce(work):
                self._finish(work, work.planned_finish)
        finally:
            self._ended(work)

    def _prefill(self, work: Work) -> float:
        if work.prefill_seconds is None:
            return self.behaviour.prefill_seconds
        return work.prefill_seconds

    @staticmethod
    def _ended(work: Work) -> None:
        work.ended = True
        work.more.set()
        work.done.set()

    async def _produce(self, work: Work) -> bool:
        """Token i comes (i + 1) / tokens_per_second after the first is begun, the pace
        resuming where it stopped when production pauses; True once every token came,
        False when the work is aborted first. Work with no tokens to produce (a decision)
        still ends only while the engine produces."""
        if not work.plan:
            return await self._until(self.producing, work)
        delay = 0.0 if self.behaviour.instant else 1.0 / self.behaviour.tokens_per_second
        plan, count = work.plan, 0
        start = time.monotonic()
        while count < len(plan):
            if not self.producing.is_set():
                if not await self._until(self.producing, work):
                    return False
                start = time.monotonic() - count * delay
            wait = start + (count + 1) * delay - time.monotonic()
            if wait > 0 and await _within(work, wait):
                return False
            due = len(plan) if delay == 0 else int((time.monotonic() - start) / delay)
            for token in plan[count : max(due, count + 1)]:
                if work.aborted.is_set() or not self.producing.is_set():
                    break
                self._emit(work, token)
                count += 1
            if work.aborted.is_set():
                return False
        return True

    async def _until(self, event: asyncio.Event, work: Work) -> bool:
        """Wait for `event`; False when the work is aborted first."""
        if work.aborted.is_set():
            return False
        if not event.is_set():
            waits = {asyncio.create_task(event.wait()), asyncio.create_task(work.aborted.wait())}
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for wait in waits:
                    wait.cancel()
        return not work.aborted.is_set()

    def _emit(self, work: Work, token: Token) -> None:
        now = time.monotonic()
        if work.first_token_at is None:
            work.first_token_at = now
            self.stats.ttft.observe(now - work.created)
        work.produced.append(token)
        work.pending.append(token)
        work.more.set()
        self.stats.generation_tokens += 1
        self.tokens_total += 1
        limit = self.behaviour.faults.die_mid_stream
        if limit is not None and self.tokens_total >= limit:
            self.on_fatal(f"the engine died after {self.tokens_total} tokens (die_mid_stream)")

    def _finish(self, work: Work, reason: Finish) -> None:
        if work.finish is not None:
            return
        work.finish = reason
        work.finished_at = time.monotonic()
        self.running.pop(work.key, None)
        self.waiting.pop(work.key, None)
        self.stats.finished[reason] += 1
        self.stats.e2e.observe(work.finished_at - work.created)
        self._schedule()
        if not self.busy and self.on_idle is not None:
            self.on_idle()

    # Control --------------------------------------------------------------------------

    def abort(self, work: Work) -> bool:
        """Stop one request now: it leaves the running or waiting count at once."""
        if work.finish is not None:
            return False
        self.stats.aborted += 1
        self._finish(work, "abort")
        work.aborted.set()
        return True

    def fail_all(self, message: str) -> None:
        """The engine died: nothing more is scheduled or produced; everything fails."""
        self.admitting = False
        self.producing.clear()
        for work in self.all_work():
            work.error = message
            self._finish(work, "error")
            work.aborted.set()

    def abort_rid(self, rid: str) -> int:
        return sum(self.abort(w) for w in self.all_work() if w.rid == rid and not w.runs_to_end)

    def abort_all(self) -> int:
        return sum(self.abort(w) for w in self.all_work())

    def all_work(self) -> list[Work]:
        return [*self.running.values(), *self.waiting.values()]

    def set_admitting(self, admitting: bool) -> None:
        self.admitting = admitting
        self._schedule()

    def set_producing(self, producing: bool) -> None:
        if producing and not self.behaviour.faults.hang:
            self.producing.set()
        else:
            self.producing.clear()

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing runs (what waits stays waiting); False on timeout."""
        running = [asyncio.create_task(w.done.wait()) for w in self.running.values()]
        if not running:
            return True
        _, pending = await asyncio.wait(running, timeout=timeout)
        for task in pending:
            task.cancel()
        return not pending


async def _within(work: Work, seconds: float) -> bool:
    """Whether the work is aborted within `seconds`."""
    try:
        await asyncio.wait_for(work.aborted.wait(), seconds)
    except TimeoutError:
        return False
    return True
