"""A consumer group's reader (`capycommon.state.streams.Reader`) on a real redis-server:
entries delivered but never acknowledged are read first, then new ones; an answer lost after
Redis delivered its entries (a read past the socket timeout, a cut connection) loses none of
them, and an entry handed out and not yet acknowledged is never handed out twice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import TimeoutError as RedisTimeoutError

from capycommon.service import redis_client
from capycommon.state.streams import Group, Reader

STREAM = "commands"


@pytest.fixture
async def client(redis_socket: Path) -> AsyncIterator[aioredis.Redis]:
    found = redis_client(f"unix://{redis_socket}")
    yield found
    await found.aclose()


class LosesAnswers(aioredis.Redis):
    """A client whose next `lose` reads are carried out by Redis and their answers thrown away,
    as a read that times out after Redis sent its answer."""

    lose = 0

    async def xreadgroup(self, *args: Any, **kwargs: Any) -> Any:
        answer = await super().xreadgroup(*args, **kwargs)
        if self.lose:
            self.lose -= 1
            raise RedisTimeoutError("Timeout reading from socket")
        return answer


@pytest.fixture
async def opened() -> AsyncIterator[list[aioredis.Redis]]:
    """The clients a test opened, closed after it."""
    clients: list[aioredis.Redis] = []
    yield clients
    for lossy in clients:
        await lossy.aclose()


async def _reader(redis_socket: Path, opened: list[aioredis.Redis]) -> tuple[Reader, LosesAnswers]:
    lossy = LosesAnswers(unix_socket_path=str(redis_socket))
    opened.append(lossy)
    reader = Reader(Group(lossy, STREAM, name="hostd", consumer="hostd"))
    await reader.group.ensure()
    return reader, lossy


async def _add(client: aioredis.Redis, *names: str) -> list[str]:
    added = [await client.xadd(STREAM, {"name": name}) for name in names]
    return [entry.decode() if isinstance(entry, bytes) else entry for entry in added]


def _names(entries: list[tuple[str, dict[bytes, bytes]]]) -> list[str]:
    return [fields[b"name"].decode() for _, fields in entries]


@pytest.mark.anyio
async def test_a_lost_answer_loses_no_entry(
    client: aioredis.Redis, redis_socket: Path, opened: list[aioredis.Redis]
) -> None:
    reader, lossy = await _reader(redis_socket, opened)
    assert await reader.read(count=16) == []  # the history is empty: new entries from now
    await _add(client, "launch a", "pull b")
    lossy.lose = 1
    with pytest.raises(RedisTimeoutError):
        await reader.read(count=16, block_ms=100)
    # Redis counts both delivered (pending); the reader reads them from the history.
    pending = await client.xpending(STREAM, "hostd")
    assert pending["pending"] == 2
    assert reader.in_history
    assert _names(await reader.read(count=16)) == ["launch a", "pull b"]
    assert await reader.read(count=16) == []
    assert reader.cursor == ">", "the history is read out: new entries from now"
    await _add(client, "stop a")
    assert _names(await reader.read(count=16, block_ms=100)) == ["stop a"]


async def _one_done_one_in_hand(
    client: aioredis.Redis, redis_socket: Path, opened: list[aioredis.Redis]
) -> tuple[Reader, LosesAnswers, str]:
    """A reader that has handed out `launch a` and `launch b` and acknowledged a (done; b
    still runs), its client, and b's entry id."""
    reader, lossy = await _reader(redis_socket, opened)
    await reader.read(count=16)
    done, running = await _add(client, "launch a", "launch b")
    assert _names(await reader.read(count=16, block_ms=100)) == ["launch a", "launch b"]
    await reader.ack(done)
    return reader, lossy, running


@pytest.mark.anyio
async def test_an_entry_in_hand_is_not_handed_out_again(
    client: aioredis.Redis, redis_socket: Path, opened: list[aioredis.Redis]
) -> None:
    reader, lossy, running = await _one_done_one_in_hand(client, redis_socket, opened)
    (lost,) = await _add(client, "pull c")
    lossy.lose = 1
    with pytest.raises(RedisTimeoutError):
        await reader.read(count=16, block_ms=100)
    # The history holds b (in hand) and c (lost): only c is handed out.
    assert _names(await reader.read(count=1)) == []  # b, skipped
    assert _names(await reader.read(count=1)) == ["pull c"]
    assert await reader.read(count=1) == []
    assert reader.held == {running, lost}


@pytest.mark.anyio
async def test_a_new_reader_takes_what_its_predecessor_never_finished_first(
    client: aioredis.Redis, redis_socket: Path, opened: list[aioredis.Redis]
) -> None:
    _, _, unfinished = await _one_done_one_in_hand(client, redis_socket, opened)
    await _add(client, "stop b")

    after, _ = await _reader(redis_socket, opened)
    assert _names(await after.read(count=16, block_ms=100)) == ["launch b"]
    assert after.held == {unfinished}
    assert _names(await after.read(count=16, block_ms=100)) == []  # the history is read out
    assert _names(await after.read(count=16, block_ms=100)) == ["stop b"]
