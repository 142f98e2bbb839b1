"""One run at a time, shared by its callers (`capycommon.flight`)."""

from __future__ import annotations

import asyncio
import gc
import time

import pytest

from capycommon.flight import Flight


class Work:
    """Work that counts its runs and ends each when `go` is set."""

    def __init__(self, fail: bool = False) -> None:
        self.runs = 0
        self.go = asyncio.Event()
        self.fail = fail

    async def __call__(self) -> int:
        self.runs += 1
        await self.go.wait()
        if self.fail:
            raise RuntimeError(f"run {self.runs} failed")
        return self.runs


@pytest.mark.anyio
async def test_callers_meanwhile_share_one_run_and_the_next_caller_starts_another() -> None:
    work = Work()
    flight = Flight(work)
    callers = [asyncio.ensure_future(flight.join()) for _ in range(3)]
    await asyncio.sleep(0)
    work.go.set()
    assert await asyncio.gather(*callers) == [1, 1, 1]
    assert await flight.join() == 2


@pytest.mark.anyio
async def test_a_run_begun_before_the_moment_asked_for_is_followed_by_another() -> None:
    work = Work()
    flight = Flight(work)
    early = asyncio.ensure_future(flight.join())
    await asyncio.sleep(0)
    late = asyncio.ensure_future(flight.join(since=time.monotonic()))
    await asyncio.sleep(0)
    work.go.set()
    assert await early == 1
    assert await late == 2, "the run under way began before it asked"


@pytest.mark.anyio
async def test_a_cancelled_caller_leaves_the_run_to_the_others() -> None:
    work = Work()
    flight = Flight(work)
    gone = asyncio.ensure_future(flight.join())
    stays = asyncio.ensure_future(flight.join())
    await asyncio.sleep(0)
    gone.cancel()
    await asyncio.sleep(0)
    work.go.set()
    assert await stays == 1
    assert gone.cancelled()
    assert work.runs == 1


@pytest.mark.anyio
async def test_a_failure_is_every_callers_and_never_left_unretrieved() -> None:
    work = Work(fail=True)
    flight = Flight(work)
    callers = [asyncio.ensure_future(flight.join()) for _ in range(2)]
    await asyncio.sleep(0)
    work.go.set()
    for found in await asyncio.gather(*callers, return_exceptions=True):
        assert isinstance(found, RuntimeError)
        assert str(found) == "run 1 failed"
    # A run whose only caller was cancelled fails with nobody to raise it to: asyncio would
    # report "Task exception was never retrieved" once the run is freed.
    reported: list[dict[str, object]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: reported.append(context))
    work.go.clear()
    alone = asyncio.ensure_future(flight.join())
    await asyncio.sleep(0)
    alone.cancel()
    work.go.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert work.runs == 2
    del flight, work, alone
    gc.collect()
    assert reported == []
