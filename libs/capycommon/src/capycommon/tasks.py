"""Work run beside a service's own loop, which never dies unseen.

A task created and cancelled at the end, its outcome never awaited, ends silently when it
fails: a router stopped reading its table again that way, and kept serving what it had. A
task run with `beside` that fails takes down the block it runs beside, and the failure
goes up from there to the service's supervision: logged with its traceback, and the process
exits for its supervisor to start it again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

log = logging.getLogger(__name__)

# How long a cancelled task may run on before it is cancelled again (`cancel_and_wait`).
RECANCEL_S = 1.0


async def cancel_and_wait(*tasks: asyncio.Future[Any]) -> None:
    """Cancel `tasks` and wait until each has ended, its outcome retrieved (read it from the
    task). One still running RECANCEL_S after its cancel is cancelled again: on Python 3.11,
    `asyncio.wait_for` drops a cancel that arrives as what it waits for completes (CPython
    gh-86296, fixed in 3.12), and redis-py's asyncio client writes each command through it.
    A loop that lost its cancel that way ran on, and whoever waited for it waited forever."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
        if pending:
            log.debug("%d task(s) ran on after their cancel; cancelled again", len(pending))
    for task in tasks:
        if not task.cancelled():
            task.exception()  # retrieved: never reported as an unretrieved failure


class TaskFailed(RuntimeError):
    """Work run beside a block failed; the block was cancelled for it."""


@asynccontextmanager
async def beside(work: Coroutine[Any, Any, None], name: str) -> AsyncIterator[asyncio.Task[None]]:
    """Run `work` while the block runs, and cancel it when the block ends. Should it fail
    first, the block is cancelled and TaskFailed raised from here, naming it."""
    owner = asyncio.current_task()
    assert owner is not None, "beside runs inside a task"
    failures: list[BaseException] = []

    def ended(task: asyncio.Task[None]) -> None:
        failure = None if task.cancelled() else task.exception()
        if failure is not None and not failures:
            failures.append(failure)
            log.error("%s failed", name, exc_info=failure)
            owner.cancel()

    task = asyncio.create_task(work, name=name)
    task.add_done_callback(ended)
    try:
        yield task
    except asyncio.CancelledError:
        if not failures:
            raise
        owner.uncancel()
    finally:
        task.remove_done_callback(ended)
        await cancel_and_wait(task)
    if not failures and not task.cancelled() and task.exception() is not None:
        ended(task)  # it failed as the block ended, before its callback ran
        owner.uncancel()
    if failures:
        raise TaskFailed(f"{name} failed: {failures[0]!r}") from failures[0]
