"""Places owned by router workers, on a real redis-server: a gone owner's places count for
nothing (but those cut before any answer, until the stop), and an owner's `keep` puts its
own count right after Redis lost it or never heard of a change."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from capycommon.service import redis_client
from capycommon.state import keys, places
from capycommon.state.places import PlaceBook
from integration.router.ready import put_ready

NAME = "m"
HOST = "local"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def client(redis_socket: Path) -> AsyncIterator[aioredis.Redis]:
    found = redis_client(f"unix://{redis_socket}")
    await put_ready(found, NAME, host=HOST)
    yield found
    await found.aclose()


async def _counts(client: aioredis.Redis) -> tuple[int, int, int]:
    found = await places.aread(client, NAME)
    return found.running, found.settle_when_idle, found.settle_at_stop


@pytest.mark.anyio
async def test_a_gone_owner_gives_back_all_but_its_cuts_at_stop(client: aioredis.Redis) -> None:
    mine, theirs = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    for book in (mine, theirs, theirs, theirs):
        assert await book.take(HOST, NAME, 1) == 1
    await theirs.cut(NAME, 1, "settle_when_idle")
    await theirs.cut(NAME, 1, "settle_at_stop")
    assert await _counts(client) == (4, 1, 1)
    await places.drop_owner(client, theirs.owner)
    assert await _counts(client) == (2, 0, 1), "one running here, one cut at stop there"
    assert await mine.keep([NAME])
    kept = set(await client.hkeys(keys.places(NAME)))
    assert kept == {b"generation", b"run:router-0:1", b"stop:router-1:2"}, (
        "the gone one's forgotten"
    )


@pytest.mark.anyio
async def test_an_owner_that_stops_refreshing_expires(client: aioredis.Redis) -> None:
    book = PlaceBook(client, "router-0:1")
    assert await book.take(HOST, NAME, 1) == 1
    await client.zadd(keys.place_owners(), {book.owner: 0})  # its time has passed
    assert await _counts(client) == (0, 0, 0)
    assert await book.keep([NAME]), "a live owner refreshes itself"
    assert await _counts(client) == (1, 0, 0)


@pytest.mark.anyio
async def test_keep_writes_back_what_redis_lost_or_never_heard(client: aioredis.Redis) -> None:
    book = PlaceBook(client, "router-0:1")
    for _ in range(3):
        assert await book.take(HOST, NAME, 1) == 1
    await book.cut(NAME, 1, "settle_at_stop")
    await client.delete(keys.places(NAME))  # a restarted Redis that lost its last writes
    assert await _counts(client) == (0, 0, 0)
    assert await book.keep([NAME])
    assert await _counts(client) == (3, 0, 1)
    await client.hset(keys.places(NAME), "run:router-0:1", 7)  # a give Redis never got
    assert await book.keep([NAME])
    assert await _counts(client) == (3, 0, 1)
    await book.give(NAME, 1, 2)
    await book.give(NAME, 1, cut="settle_at_stop")
    assert await _counts(client) == (0, 0, 0)
    assert book.held == {}


@pytest.mark.anyio
async def test_the_limit_counts_live_owners_only(client: aioredis.Redis) -> None:
    gone, live = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    assert await gone.take(HOST, NAME, 1, limit=2) == 1
    assert await gone.take(HOST, NAME, 1, limit=2) == 1
    assert await live.take(HOST, NAME, 1, limit=2) == 0, "every place taken"
    await places.drop_owner(client, gone.owner)
    assert await live.take(HOST, NAME, 1, limit=2) == 1


@pytest.mark.anyio
async def test_the_queue_bounds_count_every_live_owners_waiting(client: aioredis.Redis) -> None:
    first, second = PlaceBook(client, "router-0:1"), PlaceBook(client, "router-1:2")
    assert await first.join(NAME, 2, 3)
    assert await second.join(NAME, 2, 3)
    assert not await first.join(NAME, 2, 3), "two wait for it: full"
    assert await first.join("other", 2, 3)
    assert not await second.join("third", 2, 3), "three wait in all: full"
    await places.drop_owner(client, second.owner)
    assert await first.join(NAME, 2, 3), "the gone owner's requests wait no more"
    await client.delete(keys.waiting())  # a restarted Redis that lost its last writes
    assert await first.keep([NAME])
    assert not await second.join(NAME, 2, 3), "written back: two wait for it"
    await first.leave(NAME)
    assert await second.join(NAME, 2, 3)
