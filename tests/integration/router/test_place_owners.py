"""Places owned by router workers, on a real redis-server: a gone owner's places count for
nothing (but those cut before any answer, until the stop), an owner's `keep` puts its own
count right after Redis lost it or never heard of a change, and the spare places a worker
keeps between requests count against the limit, never as a running request. A change whose
caller gave up once it was on its way to Redis is written over at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis

from capycommon.service import redis_client
from capycommon.state import keys, places
from capycommon.state.pipe import Script
from capycommon.state.places import PlaceBook
from capycommon.state.stores import State
from capyctl_router import dispatch
from capyctl_router.dispatch import Dispatcher
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table
from integration.router.ready import put_ready
from support import wait_for_async

T = TypeVar("T")

NAME = "m"
HOST = "local"


@pytest.fixture
async def client(redis_socket: Path) -> AsyncIterator[aioredis.Redis]:
    found = redis_client(f"unix://{redis_socket}")
    await put_ready(found, NAME, host=HOST)
    yield found
    await found.aclose()


@pytest.fixture
def state(client: aioredis.Redis) -> State:
    return State(client)


@pytest.fixture
def quick_book(client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> PlaceBook:
    """A worker's book whose spares are given back after 0.3 s unused."""
    monkeypatch.setattr(places, "SPARE_IDLE_S", 0.3)
    return PlaceBook(client, "router-0:1")


async def _counts(state: State) -> tuple[int, int, int]:
    found = await state.places.get(NAME)
    return found.running, found.settle_when_idle, found.settle_at_stop


@pytest.mark.anyio
async def test_a_gone_owner_gives_back_all_but_its_cuts_at_stop(
    client: aioredis.Redis, state: State
) -> None:
    mine, theirs = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    for book in (mine, theirs, theirs, theirs):
        assert await book.take(HOST, NAME, 1) == 1
    await theirs.cut(NAME, 1, "settle_when_idle")
    await theirs.cut(NAME, 1, "settle_at_stop")
    assert await _counts(state) == (4, 1, 1)
    await state.places.drop_owner(theirs.owner)
    assert await _counts(state) == (2, 0, 1), "one running here, one cut at stop there"
    assert await mine.keep([NAME])
    kept = set(await client.hkeys(keys.places(NAME)))
    assert kept == {b"generation", b"run:router-0:1", b"stop:router-1:2"}, (
        "the gone one's forgotten"
    )


@pytest.mark.anyio
async def test_an_owner_that_stops_refreshing_expires(client: aioredis.Redis, state: State) -> None:
    book = PlaceBook(client, "router-0:1")
    assert await book.take(HOST, NAME, 1) == 1
    await client.zadd(keys.place_owners(), {book.owner: 0})  # its time has passed
    assert await _counts(state) == (0, 0, 0)
    assert await book.keep([NAME]), "a live owner refreshes itself"
    assert await _counts(state) == (1, 0, 0)


@pytest.mark.anyio
async def test_keep_writes_back_what_redis_lost_or_never_heard(
    client: aioredis.Redis, state: State
) -> None:
    book = PlaceBook(client, "router-0:1")
    for _ in range(3):
        assert await book.take(HOST, NAME, 1) == 1
    await book.cut(NAME, 1, "settle_at_stop")
    await client.delete(keys.places(NAME))  # a restarted Redis that lost its last writes
    assert await _counts(state) == (0, 0, 0)
    assert await book.keep([NAME])
    assert await _counts(state) == (3, 0, 1)
    await client.hset(keys.places(NAME), "run:router-0:1", 7)  # a give Redis never got
    assert await book.keep([NAME])
    assert await _counts(state) == (3, 0, 1)
    await book.give(NAME, 1, 2)
    await book.give(NAME, 1, cut="settle_at_stop")
    assert await _counts(state) == (0, 0, 0)
    assert book.held == {}


@pytest.mark.anyio
async def test_the_limit_counts_live_owners_only(client: aioredis.Redis, state: State) -> None:
    gone, live = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    assert await gone.take(HOST, NAME, 1, limit=2) == 1
    assert await gone.take(HOST, NAME, 1, limit=2) == 1
    assert await live.take(HOST, NAME, 1, limit=2) == 0, "every place taken"
    await state.places.drop_owner(gone.owner)
    assert await live.take(HOST, NAME, 1, limit=2) == 1


@pytest.mark.anyio
async def test_the_queue_bounds_count_every_live_owners_waiting(
    client: aioredis.Redis, state: State
) -> None:
    first, second = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    assert await first.join(NAME, 2, 3)
    assert await second.join(NAME, 2, 3)
    assert not await first.join(NAME, 2, 3), "two wait for it: full"
    assert await first.join("other", 2, 3)
    assert not await second.join("third", 2, 3), "three wait in all: full"
    await state.places.drop_owner(second.owner)
    assert await first.join(NAME, 2, 3), "the gone owner's requests wait no more"
    await client.delete(keys.waiting())  # a restarted Redis that lost its last writes
    assert await first.keep([NAME])
    assert not await second.join(NAME, 2, 3), "written back: two wait for it"
    await first.leave(NAME)
    assert await second.join(NAME, 2, 3)


async def _spares(state: State) -> tuple[int, int]:
    found = await state.places.get(NAME)
    return found.running, found.spare


async def _calls(client: aioredis.Redis) -> int:
    """Scripts Redis ran so far."""
    stats = await client.info("commandstats")
    return sum(
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval")
    )


@pytest.mark.anyio
async def test_a_kept_spare_serves_the_next_request_without_redis(
    client: aioredis.Redis, state: State
) -> None:
    book = PlaceBook(client, "router-0:1")
    assert await book.take(HOST, NAME, 1) == 1
    await book.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (0, 1), "kept: no request runs on it"
    before = await _calls(client)
    for _ in range(5):
        assert book.use_spare(NAME, 1)
        assert not book.use_spare(NAME, 1), "one spare, one request at a time"
        await book.end(NAME, 1, spare=True, keep=True)
    assert await _calls(client) == before, "five requests, no script"
    assert not book.use_spare(NAME, 2), "not for another generation"
    assert await _spares(state) == (0, 1)


@pytest.mark.anyio
async def test_spares_count_against_the_limit_until_given_back(
    client: aioredis.Redis, state: State
) -> None:
    first, second = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    assert await first.take(HOST, NAME, 1, limit=4) == 1, "the only owner: all 4 its share"
    assert await first.take(HOST, NAME, 1, limit=4) == 1
    await first.end(NAME, 1, spare=False, keep=True)
    await first.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (0, 2), "both kept"
    for _ in range(2):
        assert await second.take(HOST, NAME, 1, limit=4) == 1
    assert await second.take(HOST, NAME, 1, limit=4) == 0, "the spares hold the last places"
    await first.drop_spares(NAME)
    assert await second.take(HOST, NAME, 1, limit=4) == 1
    assert await _spares(state) == (3, 0)
    assert first.held == {}


@pytest.mark.anyio
async def test_no_spare_is_kept_beyond_the_owners_share(
    client: aioredis.Redis, state: State
) -> None:
    mine, theirs = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    assert await theirs.take(HOST, NAME, 1, limit=4) == 1
    for _ in range(3):
        assert await mine.take(HOST, NAME, 1, limit=4) == 1, "two live owners: a share of 2"
    await mine.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (3, 0), "it held 3: given back, others may need it"
    await mine.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (2, 1), "it held 2, its share: kept"
    await mine.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (1, 2), "it held 2 again: kept"
    assert mine.use_spare(NAME, 1)
    assert mine.use_spare(NAME, 1)
    assert not mine.use_spare(NAME, 1), "one request a spare"


@pytest.mark.anyio
async def test_the_share_is_over_the_routers_workers_or_more_live_owners(
    client: aioredis.Redis,
    state: State,
) -> None:
    mine = PlaceBook(client, "router-0:1", workers=2)
    for _ in range(2):
        assert await mine.take(HOST, NAME, 1, limit=8) == 1
    assert mine.share(NAME) == 4, "alone for now, but one of two workers: a worker forked again"
    others = [PlaceBook(client, f"other-{n}:{n}") for n in range(3)]
    for other in others:
        assert await other.keep([NAME]), "another router's workers"
    assert await mine.keep([NAME])
    assert mine.share(NAME) == 2, "four live owners, learnt at the keep"
    for _ in range(2):
        await mine.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (0, 2), "it held 2, its share: both kept"
    await state.places.drop_owner(others[0].owner)
    assert mine.use_spare(NAME, 1)
    assert await mine.take(HOST, NAME, 1, limit=8) == 1, "three live owners now: a share of 2"
    await mine.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (0, 2), "it held 3: given back (the spare in use stays)"


@pytest.mark.anyio
async def test_a_free_spare_never_keeps_another_owner_from_its_share(
    client: aioredis.Redis,
    state: State,
) -> None:
    mine, theirs = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    assert await mine.keep([NAME]), "mine is a live owner before theirs takes"
    for _ in range(2):
        assert await theirs.take(HOST, NAME, 1, limit=4) == 1
    for _ in range(2):
        await theirs.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (0, 2), "two live owners: its share of 2 kept"
    assert theirs.use_spare(NAME, 1)
    assert theirs.use_spare(NAME, 1)
    assert await theirs.take(HOST, NAME, 1, limit=4) == 1, "its spares in use: it takes"
    await theirs.end(NAME, 1, spare=True, keep=True)
    assert await _spares(state) == (1, 1), "it held 3: given back"
    await theirs.end(NAME, 1, spare=True, keep=True)
    await theirs.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (0, 2), "its share, no more"
    for _ in range(2):
        assert await mine.take(HOST, NAME, 1, limit=4) == 1, "its share of 2"
    assert await mine.take(HOST, NAME, 1, limit=4) == 0, "the limit holds, the spares in it"


@pytest.mark.anyio
async def test_a_spare_ends_given_back_unless_its_instance_is_still_ready(
    client: aioredis.Redis,
    state: State,
) -> None:
    book = PlaceBook(client, "router-0:1")
    assert await book.take(HOST, NAME, 1) == 1
    await book.end(NAME, 1, spare=False, keep=True)
    assert book.use_spare(NAME, 1)
    await book.end(NAME, 1, spare=True, keep=False)
    assert await _spares(state) == (0, 0)
    assert book.held == {}
    assert not book.use_spare(NAME, 1)


@pytest.mark.anyio
async def test_an_unused_spare_is_given_back(
    client: aioredis.Redis, state: State, quick_book: PlaceBook
) -> None:
    book = quick_book
    assert await book.take(HOST, NAME, 1) == 1
    await book.end(NAME, 1, spare=False, keep=True)
    await book.drop_idle_spares()
    assert await _spares(state) == (0, 1), "just kept"
    due = book.spares_due()
    assert due is not None

    async def given_back() -> bool:
        await book.drop_idle_spares()
        return await _spares(state) == (0, 0)

    await wait_for_async(given_back, timeout=5, what="the unused spare given back", interval=0.05)
    assert time.monotonic() >= due
    assert book.spares_due() is None


@pytest.mark.anyio
async def test_spares_beyond_what_the_requests_use_are_given_back(
    client: aioredis.Redis, state: State, quick_book: PlaceBook
) -> None:
    book = quick_book
    for _ in range(3):
        assert await book.take(HOST, NAME, 1) == 1
    for _ in range(3):
        await book.end(NAME, 1, spare=False, keep=True)
    assert await _spares(state) == (0, 3), "a burst of three: three kept"
    started = time.monotonic()

    async def down_to_the_one_in_use() -> bool:
        assert book.use_spare(NAME, 1), "a request a turn uses the newest spare"
        await book.end(NAME, 1, spare=True, keep=True)
        await book.drop_idle_spares()
        return await _spares(state) == (0, 1)

    await wait_for_async(down_to_the_one_in_use, timeout=5, what="the unused two given back")
    assert time.monotonic() - started >= 0.3
    used_past = time.monotonic() + 0.4  # past SPARE_IDLE_S, a request after another
    while time.monotonic() < used_past:
        assert await down_to_the_one_in_use(), "the one in use stays"


@pytest.mark.anyio
async def test_a_request_cut_on_a_spare_counts_as_cut(client: aioredis.Redis, state: State) -> None:
    book = PlaceBook(client, "router-0:1")
    assert await book.take(HOST, NAME, 1) == 1
    await book.end(NAME, 1, spare=False, keep=True)
    assert book.use_spare(NAME, 1)
    await book.cut(NAME, 1, "settle_at_stop", spare=True)
    assert await _counts(state) == (1, 0, 1)
    assert await _spares(state) == (1, 0)


@pytest.mark.anyio
async def test_keep_writes_spares_back_and_a_gone_owners_count_for_nothing(
    client: aioredis.Redis,
    state: State,
) -> None:
    mine, theirs = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    for book in (mine, theirs):
        assert await book.take(HOST, NAME, 1) == 1
        await book.end(NAME, 1, spare=False, keep=True)
    await client.delete(keys.places(NAME))  # a restarted Redis that lost its last writes
    assert await mine.keep([NAME])
    assert await theirs.keep([NAME])
    assert await _spares(state) == (0, 2)
    await state.places.drop_owner(theirs.owner)
    assert await _spares(state) == (0, 1)
    assert await mine.keep([NAME])
    kept = set(await client.hkeys(keys.places(NAME)))
    assert kept == {b"generation", b"spare:router-0:1"}, "the gone one's forgotten"


# Holds Redis for ARGV[1] microseconds: commands sent meanwhile wait there, unanswered.
BUSY = Script.of("""
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat
  t = redis.call('TIME')
until t[1] * 1000000 + t[2] - start >= tonumber(ARGV[1])
""")


async def _cut_short(
    book: PlaceBook,
    change: Callable[[], Coroutine[Any, Any, T]],
    undo: Callable[[], Coroutine[Any, Any, object]],
) -> T:
    """Make `change` in full and `undo` it (Redis then has the book's scripts, and the book's
    one connection is open), then send `change` again behind a script that holds Redis for
    0.3 s, on that connection, and cancel its caller once it is written: Redis makes it after
    the caller gave up, as when a client hangs up at that moment. Returns what the change
    made in full returned."""
    made = await change()
    await undo()
    await book.pipe.run(BUSY, [], [0])  # Redis has the script: it is not sent again behind
    holding = asyncio.ensure_future(book.pipe.run(BUSY, [], [300_000]))
    task = asyncio.ensure_future(change())
    for _ in range(3):  # the pipe writes what was sent in the loop's next turn
        await asyncio.sleep(0)
    assert task.cancel(), "cancelled while Redis holds it"
    with pytest.raises(asyncio.CancelledError):
        await task
    await holding
    return made


def _book_heard(client: aioredis.Redis) -> tuple[PlaceBook, list[bool]]:
    """A worker's book, and what it tells its owner when it is unsure of its counts: True,
    each time."""
    book = PlaceBook(client, "router-0:1")
    heard: list[bool] = []
    book.on_unsure = lambda: heard.append(True)
    return book, heard


@pytest.mark.anyio
async def test_a_join_cut_short_is_written_over_at_once(
    client: aioredis.Redis, state: State
) -> None:
    book, heard = _book_heard(client)
    assert await _cut_short(book, lambda: book.join(NAME, 10, 10), lambda: book.leave(NAME))
    assert book.waiting[NAME] == 0, "its caller never heard it joined"
    assert await state.places.waiting() == {NAME: 1}, "Redis counted it"
    assert heard == [True]
    assert book.unsure
    assert await book.keep([NAME])
    assert await state.places.waiting() == {}
    assert not book.unsure


@pytest.mark.anyio
async def test_a_take_cut_short_is_written_over_at_once(
    client: aioredis.Redis, state: State
) -> None:
    book, heard = _book_heard(client)
    taken = await _cut_short(book, lambda: book.take(HOST, NAME, 1), lambda: book.give(NAME, 1))
    assert taken == 1
    assert book.held == {}
    assert await _counts(state) == (1, 0, 0), "Redis counted the place taken"
    assert heard == [True]
    assert await book.keep([NAME])
    assert await _counts(state) == (0, 0, 0)
    assert not book.unsure


@pytest.mark.anyio
async def test_a_router_keeps_at_once_after_a_change_cut_short(
    client: aioredis.Redis, state: State, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dispatch, "KEEP_EVERY_S", 60.0)  # no keep comes on its own
    table = Table(state, {HOST})
    await table.sync()
    dispatcher = Dispatcher(state, table, Metrics())
    book = dispatcher.book
    stop = asyncio.Event()
    settling = asyncio.ensure_future(dispatcher.settle(stop))
    try:
        await wait_for_async(
            lambda: client.zscore(keys.place_owners(), book.owner), 2, "the first keep"
        )
        assert await _cut_short(book, lambda: book.join(NAME, 10, 10), lambda: book.leave(NAME))
        await wait_for_async(
            lambda: _written_over(book, state), 2, "the router to write its count over"
        )
    finally:
        stop.set()
        await settling


async def _written_over(book: PlaceBook, state: State) -> bool:
    """A keep ran since the change was cut short (sent after it, so run after it), and
    nobody waits."""
    return not book.unsure and await state.places.waiting() == {}
