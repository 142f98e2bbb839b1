"""Work run beside a block: a failure takes the block down and is raised, naming the work;
work that ends quietly, or is cancelled at the block's end, raises nothing."""

from __future__ import annotations

import asyncio

import pytest

from capycommon import tasks
from capycommon.tasks import TaskFailed, beside

pytestmark = pytest.mark.anyio


async def _fail_when(event: asyncio.Event) -> None:
    await event.wait()
    raise ValueError("a bad record")


async def test_a_failure_beside_cancels_the_block_and_is_raised() -> None:
    go = asyncio.Event()
    reached = asyncio.Event()

    async def block() -> None:
        async with beside(_fail_when(go), "resync"):
            reached.set()
            go.set()
            await asyncio.Event().wait()  # a loop that would never end on its own

    with pytest.raises(TaskFailed, match="resync failed: ValueError") as caught:
        await block()
    assert reached.is_set()
    assert isinstance(caught.value.__cause__, ValueError)
    assert not asyncio.current_task().cancelling()  # type: ignore[union-attr]


async def test_work_that_ends_quietly_or_outlives_the_block_raises_nothing() -> None:
    async def quiet() -> None:
        return None

    async with beside(quiet(), "quiet") as task:
        await task
    forever = asyncio.Event()
    async with beside(forever.wait(), "forever") as task:  # type: ignore[arg-type]
        pass
    assert task.cancelled()


async def test_a_cancel_from_outside_still_cancels() -> None:
    started = asyncio.Event()

    async def body() -> None:
        async with beside(asyncio.Event().wait(), "idle"):  # type: ignore[arg-type]
            started.set()
            await asyncio.Event().wait()

    outer = asyncio.create_task(body())
    await started.wait()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer


async def _loses_its_first_cancel(ran_on: asyncio.Event) -> None:
    """A loop that loses one cancel, as a task can inside Python 3.11's `asyncio.wait_for`
    (CPython gh-86296): it runs on as if none had come."""
    lost = False
    while True:
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if lost:
                raise
            lost = True
            ran_on.set()


async def test_a_task_that_lost_its_cancel_is_cancelled_again_until_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tasks, "RECANCEL_S", 0.05)
    ran_on = asyncio.Event()
    task = asyncio.create_task(_loses_its_first_cancel(ran_on))
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await tasks.cancel_and_wait(task)
    assert ran_on.is_set(), "the first cancel was lost"
    assert task.cancelled()


async def test_cancel_and_wait_retrieves_a_failure_and_leaves_done_tasks_as_they_are() -> None:
    failed = asyncio.create_task(_fail_when(_set_event()))
    done = asyncio.create_task(asyncio.sleep(0, result="kept"))
    await asyncio.wait({failed, done})
    await tasks.cancel_and_wait(failed, done)
    assert isinstance(failed.exception(), ValueError)
    assert done.result() == "kept"


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event
