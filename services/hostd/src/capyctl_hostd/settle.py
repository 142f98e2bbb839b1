"""Following an aborted request to its end in the engine, and saying so in Redis.

For an engine whose capabilities say it shows when an aborted request ends (SGLang 0.5.22 and
later), hostd aborts by id while watching the engine's abort count: a count that moves by one
says the engine held the request; then hostd repeats the abort, backing off, until one that
moves nothing shows the engine holds the request no more, and appends a `RequestEnd` for
the router. The first abort of a request it did not hold ends the watch at once, reported as
not held (an answered request has then ended; one cut before any answer may still arrive).

Calls that read the count run one at a time per engine, so hostd's own aborts of two requests
never mingle. SGLang also aborts a hung-up request by itself, 2 s (streamed) or up to 4 s
(not streamed) after its connection closed; by then hostd's abort has normally ended it, so
that abort counts nothing. A count that moves by more than one proves nothing and is taken
as not held.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from capycommon.domain.hosts import RequestEnd
from capycommon.domain.instances import InstanceRecord
from capycommon.engines.sglang import SglangControl
from capycommon.errors import CapyError
from capycommon.service import REDIS_ERRORS
from capycommon.state.stores import State
from capyctl_hostd.engines import Engine

log = logging.getLogger(__name__)
# Waits between repeated aborts: quick at first (a waiting request ends at once, a running
# one at the scheduler's next step), then once a second, for a minute at most.
BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.8)
FOLLOW_S = 60.0


@dataclass
class Settler:
    """Follows aborted requests to their end; one reader of each engine's count at a time."""

    state: State
    host: str
    _locks: dict[int, asyncio.Lock] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def follow(self, engine: Engine, record: InstanceRecord, request_id: str) -> None:
        """Abort `request_id` and follow it in the background (commands are not held up)."""
        task = asyncio.create_task(self._follow(engine, record, request_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _follow(self, engine: Engine, record: InstanceRecord, request_id: str) -> None:
        lock = self._locks.setdefault(engine.pgid, asyncio.Lock())
        control = engine.control()
        assert isinstance(control, SglangControl)
        try:
            async with lock:
                moved = await control.abort_counted(request_id)
            held = moved == 1
            if moved and not await _until_gone(control, lock, request_id):
                log.info(
                    "%s: request %s still runs after %g s", record.member, request_id, FOLLOW_S
                )
                return
            end = RequestEnd(
                deployment=record.deployment,
                instance=record.instance,
                generation=record.generation,
                request_id=request_id,
                held=held,
                at=time.time(),
            )
            await self.state.settlement.publish(self.host, end)
        except CapyError as exc:  # the engine stopped or failed: its stop settles the request
            log.info("%s: request %s not followed: %s", record.member, request_id, exc.message)
        except REDIS_ERRORS as exc:
            log.warning(
                "%s: the end of request %s not reported: %s", record.member, request_id, exc
            )


async def _until_gone(control: SglangControl, lock: asyncio.Lock, request_id: str) -> bool:
    """Repeat the abort until one counts nothing; False if the request outlives FOLLOW_S."""
    deadline = time.monotonic() + FOLLOW_S
    step = 0
    while time.monotonic() < deadline:
        await asyncio.sleep(BACKOFF_S[step] if step < len(BACKOFF_S) else 1.0)
        step += 1
        async with lock:
            if await control.abort_counted(request_id) == 0:
                return True
    return False
