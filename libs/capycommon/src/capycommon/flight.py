"""One run of some work at a time, shared by every caller that asks for it while it runs.

A connection opened once for every command waiting for it, a read of Redis made once for
every request that missed meanwhile: each caller joins the run under way, or starts one. A
caller that needs a run begun after some moment (a read that may predate what it looks for)
waits for the next run when the one under way began too early.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Flight(Generic[T]):
    """Runs `work` for its callers, one run at a time. A caller cancelled while it waits
    leaves the run going for the others; the run's failure is raised to every caller
    waiting, and is never reported as unretrieved when none is left (each caller waits
    through `asyncio.shield`, which marks it retrieved for a caller that left)."""

    def __init__(self, work: Callable[[], Awaitable[T]]) -> None:
        self._work = work
        # The run under way, and when it began (monotonic).
        self._running: tuple[float, asyncio.Future[T]] | None = None

    async def join(self, since: float = float("-inf")) -> T:
        """What a run begun at `since` (monotonic) or later gave: the run under way when it
        began then, else the next, started once the one under way has ended."""
        while True:
            running = self._running
            if running is None:
                running = self._running = (time.monotonic(), asyncio.ensure_future(self._work()))
            began, task = running
            try:
                result = await asyncio.shield(task)
            finally:
                if task.done() and self._running is running:
                    self._running = None
            if began >= since:
                return result
