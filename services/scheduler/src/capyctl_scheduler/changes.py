"""A count of the notifications the scheduler heard, and a wait for the next one: what the
status page's live updates follow (the same pub/sub notifications the planning loop does)."""

from __future__ import annotations

import asyncio
import contextlib


class Changes:
    def __init__(self) -> None:
        self.count = 0
        # The scheduler is stopping: whoever follows the changes stops too.
        self.closed = False
        self._next = asyncio.Event()

    def note(self) -> None:
        """Something changed (or may have: a subscription was made anew)."""
        self.count += 1
        self._next.set()
        self._next = asyncio.Event()

    def close(self) -> None:
        self.closed = True
        self.note()

    async def after(self, seen: int, timeout: float) -> int:
        """The count once it passed `seen`, or after `timeout` seconds, whichever is first."""
        if self.count == seen:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._next.wait(), timeout)
        return self.count
