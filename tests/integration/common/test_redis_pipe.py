"""The pipe to Redis (`capycommon.state.pipe`) on a real redis-server: concurrent commands on
its one connection each get their own answer; scripts run by SHA1 survive a flushed script
cache; error answers fail only their command (MISCONF as RedisCannotWrite); a timeout, or
Redis stopping, fails the commands on the connection quickly, and the next command opens a
new one."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from capycommon.service import RedisCannotWrite, redis_client
from capycommon.state.pipe import Address, Pipe, Script
from capycommon.state.places import PlaceBook
from integration.router.ready import put_ready
from support import short_dir, wait_for

COUNTER = Script.of("return redis.call('INCRBY', KEYS[1], ARGV[1])")


class Server:
    """A redis-server on a unix socket that a test stops and starts again; its data lives in
    `data` (which a test may remove, so that saving fails)."""

    def __init__(self) -> None:
        self.folder = short_dir("pipe")
        self.socket = self.folder / "redis.sock"
        self.data = self.folder / "data"
        self.data.mkdir()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            pytest.fail("redis-server is not installed; run scripts/setup")
        self.proc = subprocess.Popen(
            [
                server,
                *("--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700"),
                *("--dir", str(self.data), "--save", "", "--appendonly", "no"),
            ],
            stdout=subprocess.DEVNULL,
        )
        wait_for(self.socket.exists, timeout=10, what="redis-server's socket")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # a Redis that cannot save will not stop
                self.proc.kill()
                self.proc.wait(timeout=5)
            self.proc = None
        wait_for(lambda: not self.socket.exists(), timeout=10, what="the socket removed")


@pytest.fixture
def server() -> Iterator[Server]:
    found = Server()
    found.start()
    try:
        yield found
    finally:
        found.stop()
        shutil.rmtree(found.folder, ignore_errors=True)


@pytest.fixture
async def client(server: Server) -> AsyncIterator[aioredis.Redis]:
    found = redis_client(f"unix://{server.socket}")
    yield found
    await found.aclose()  # closes its pipe too


@pytest.mark.anyio
async def test_concurrent_commands_each_get_their_own_answer(client: aioredis.Redis) -> None:
    pipe = Pipe.of(client)
    assert Pipe.of(client) is pipe, "one pipe a client"
    echoes = [pipe.execute("ECHO", f"echo-{n}") for n in range(300)]
    counts = [pipe.run(COUNTER, [f"count-{n % 7}"], [n]) for n in range(300)]
    found = await asyncio.gather(*echoes, *counts)
    assert found[:300] == [f"echo-{n}".encode() for n in range(300)]
    assert [await client.get(f"count-{k}") for k in range(7)] == [
        str(sum(n for n in range(300) if n % 7 == k)).encode() for k in range(7)
    ]
    assert await pipe.execute("HSET", "h", "a", 1, "b", 2.5) == 2
    assert await pipe.execute("HGETALL", "h") == [b"a", b"1", b"b", b"2.5"]
    assert await pipe.execute("GET", "missing") is None
    assert await pipe.execute("SET", "big", b"x" * 200_000) == b"OK"
    assert await pipe.execute("GET", "big") == b"x" * 200_000, "an answer in many reads"


@pytest.mark.anyio
async def test_a_script_runs_again_after_its_cache_is_flushed(client: aioredis.Redis) -> None:
    pipe = Pipe.of(client)
    assert await pipe.run(COUNTER, ["n"], [1]) == 1
    await client.script_flush()
    assert await client.script_exists(COUNTER.sha.decode()) == [False]
    assert await asyncio.gather(*(pipe.run(COUNTER, ["n"], [1]) for _ in range(5))) == [
        2,
        3,
        4,
        5,
        6,
    ]
    assert await client.script_exists(COUNTER.sha.decode()) == [True], "loaded again"


@pytest.mark.anyio
async def test_an_error_answer_fails_only_its_command(client: aioredis.Redis) -> None:
    pipe = Pipe.of(client)
    await client.set("text", "not a number")
    found = await asyncio.gather(
        pipe.execute("ECHO", "before"),
        pipe.execute("INCR", "text"),
        pipe.run(Script.of("return redis.call('INCR', KEYS[1])"), ["text"], []),
        pipe.execute("NOSUCHCOMMAND"),
        pipe.execute("ECHO", "after"),
        return_exceptions=True,
    )
    assert found[0] == b"before"
    assert found[4] == b"after"
    for error in found[1:4]:
        assert type(error) is ResponseError, error
    assert "not an integer" in str(found[1])
    assert await pipe.execute("ECHO", "still") == b"still"


@pytest.mark.anyio
async def test_a_redis_that_cannot_save_refuses_writes_as_misconf(
    server: Server, client: aioredis.Redis
) -> None:
    await put_ready(client, "m", host="local")
    book = PlaceBook(client, "router-0:1")
    assert await book.take("local", "m", 1) == 1
    shutil.rmtree(server.data)  # Redis's working folder: a save cannot write its file
    await client.config_set("save", "3600 1")
    await client.bgsave()

    async def failed() -> bool:
        info = await client.info("persistence")
        return bool(info["rdb_bgsave_in_progress"] == 0 and info["rdb_last_bgsave_status"] == "err")

    deadline = time.monotonic() + 10
    while not await failed():
        assert time.monotonic() < deadline, "the save did not fail"
        await asyncio.sleep(0.05)
    pipe = Pipe.of(client)
    with pytest.raises(RedisCannotWrite, match="write"):
        await pipe.execute("SET", "k", "v")
    with pytest.raises(RedisCannotWrite):
        await book.take("local", "m", 1)
    assert await pipe.execute("ECHO", "reads work") == b"reads work"
    await client.config_set("save", "")  # so that it can stop


@pytest.mark.anyio
async def test_a_stopped_redis_fails_fast_and_the_next_command_reconnects(
    server: Server, client: aioredis.Redis
) -> None:
    pipe = Pipe.of(client)
    assert await pipe.execute("SET", "k", "1") == b"OK"
    waiting = asyncio.ensure_future(pipe.execute("BLPOP", "nothing", 0))
    await asyncio.sleep(0.05)
    server.stop()
    started = time.monotonic()
    with pytest.raises(RedisConnectionError):
        await waiting
    with pytest.raises(RedisConnectionError, match="cannot connect"):
        await pipe.execute("GET", "k")
    assert time.monotonic() - started < 1.0
    server.start()
    assert await pipe.execute("ECHO", "back") == b"back"


@pytest.mark.anyio
async def test_a_timeout_fails_the_connection_and_the_next_command_reconnects(
    server: Server,
) -> None:
    pipe = Pipe(Address(path=str(server.socket), timeout_s=0.3))
    try:
        slow = asyncio.ensure_future(pipe.execute("BLPOP", "nothing", 2))
        behind = asyncio.ensure_future(pipe.execute("ECHO", "behind"))
        started = time.monotonic()
        with pytest.raises(RedisTimeoutError, match=r"did not answer in 0\.3 s"):
            await slow
        assert 0.25 < time.monotonic() - started < 1.0
        with pytest.raises(RedisConnectionError, match="timed out"):
            await behind
        assert await pipe.execute("ECHO", "again") == b"again"
    finally:
        pipe.close()


@pytest.mark.anyio
async def test_a_cancelled_command_leaves_the_answers_in_order_or_is_not_sent(
    server: Server,
) -> None:
    pipe = Pipe(Address(path=str(server.socket)))
    try:
        assert await pipe.execute("SET", "k", "v") == b"OK"
        slow = asyncio.ensure_future(pipe.execute("BLPOP", "nothing", 0.2))
        behind = asyncio.ensure_future(pipe.execute("GET", "k"))
        await asyncio.sleep(0.05)
        slow.cancel()
        assert await behind == b"v"
        assert await pipe.execute("ECHO", "next") == b"next"
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0):  # given up before it was written
                await pipe.execute("SET", "k", "changed")
        assert await pipe.execute("GET", "k") == b"v", "a command given up is not sent"
    finally:
        pipe.close()


@pytest.mark.anyio
async def test_a_password_and_a_database_are_used(server: Server) -> None:
    admin = redis_client(f"unix://{server.socket}")
    await admin.config_set("requirepass", "secret")
    await admin.aclose()
    client = redis_client(f"unix://{server.socket}?db=3&password=secret")
    try:
        assert await Pipe.of(client).execute("SET", "in-3", "yes") == b"OK"
        assert await client.get("in-3") == b"yes"
        refused = Pipe(Address(path=str(server.socket), password="wrong"))
        with pytest.raises(RedisConnectionError, match="invalid username-password"):
            await refused.execute("PING")
    finally:
        await client.aclose()
