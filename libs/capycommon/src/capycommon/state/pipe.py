"""One multiplexed connection to Redis for the commands a service sends on every request.

redis-py's asyncio client costs a router worker about a fifth of its CPU a request for the
two scripts each request runs (a place taken, then given back): its blocking pool takes and
gives back a connection under an asyncio.Condition, checks that connection with a syscall
before every command, and arms a wait_for for every read. The scripts need none of that: a
command is written as soon as it is sent, on one connection that every command shares, and
Redis answers them in the order they came, so each answer goes to the oldest command waiting.

A command waits at most the client's socket_timeout for its answer. Past it the connection
is closed and every command on it fails: a later answer could no longer be told from a
late one. The connection failing (Redis stopped, reset, not speaking RESP) fails the commands
on it the same way, and the next command opens a new one. A command whose caller gave up
(cancelled, or out of time) before it was written is not sent at all. Failures are redis-py's own
exceptions, which callers already catch: ConnectionError, TimeoutError, and ResponseError
(RedisCannotWrite for Redis's MISCONF refusal) for an error answer.

The pipe speaks TLS where its client's pool does (the certificate files read at each
connect). On replicated servers (a pool that asks the Sentinels, `capycommon.state.primary`)
it asks them for the primary at each connect, and a READONLY answer, which says the Redis it
talks to was made a replica, fails the connection as lost (ConnectionError): the next command
connects to the new primary.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeAlias, cast

import redis.asyncio as aioredis
from redis._parsers import _AsyncRESP2Parser
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from capycommon.flight import Flight

# An answer: an integer, a string (bytes), nil, or an array of answers; an error answer
# inside an array stays there as its exception.
Reply: TypeAlias = Any
Arg: TypeAlias = bytes | str | int | float
# Where the primary is now, (host, port): asked at each connect of a replicated target's pipe.
Locate: TypeAlias = Callable[[], Awaitable[tuple[str, int]]]


class RedisCannotWrite(ResponseError):
    """Redis refuses every write because it cannot save them (its MISCONF answer), most often
    because its disk is full. It takes writes again on its own once it can save."""


class RedisBusy(ResponseError):
    """Redis is running a script past its time limit and answers nothing else (its BUSY
    answer) until the script ends or is killed (`capyctl_scheduler.redisguard`)."""


class ReplyParser(_AsyncRESP2Parser):
    """redis-py's parser, raising Redis's MISCONF refusal as RedisCannotWrite and its BUSY
    answer as RedisBusy; its error mapping is the pipe's too."""

    EXCEPTION_CLASSES = {  # noqa: RUF012 - a plain class dict, as in its base
        **_AsyncRESP2Parser.EXCEPTION_CLASSES,
        "MISCONF": RedisCannotWrite,
        "BUSY": RedisBusy,
    }


@dataclass(frozen=True)
class Script:
    """A Lua script, sent by its SHA1 and loaded on Redis's NOSCRIPT answer."""

    source: bytes
    sha: bytes

    @classmethod
    def of(cls, source: str) -> Script:
        encoded = source.encode()
        return cls(encoded, hashlib.sha1(encoded, usedforsecurity=False).hexdigest().encode())


@dataclass(frozen=True)
class Tls:
    """The certificate a TLS connection presents and the authority it trusts, as a redis-py
    pool has them: read at each connect, so a renewed certificate is used without a
    restart."""

    certificate: str | None = None
    key: str | None = None
    authority: str | None = None
    verify: bool = True
    check_hostname: bool = True

    @classmethod
    def of(cls, found: Mapping[str, Any]) -> Tls:
        reqs = found.get("ssl_cert_reqs", "required")
        return cls(
            certificate=found.get("ssl_certfile"),
            key=found.get("ssl_keyfile"),
            authority=found.get("ssl_ca_certs"),
            verify=reqs not in {"none", ssl.CERT_NONE},
            check_hostname=bool(found.get("ssl_check_hostname", True)),
        )

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.authority)
        context.check_hostname = self.verify and self.check_hostname
        if not self.verify:
            context.verify_mode = ssl.CERT_NONE
        if self.certificate is not None:
            context.load_cert_chain(self.certificate, self.key)
        return context


@dataclass(frozen=True)
class Address:
    """Where Redis listens and how to open a session there, as a redis-py client has it."""

    path: str | None = None
    host: str = "localhost"
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = None
    timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    tls: Tls | None = None

    @classmethod
    def of(cls, client: aioredis.Redis) -> Address:
        pool = client.connection_pool
        found = pool.connection_kwargs
        timeout = found.get("socket_timeout") or 5.0
        secure = issubclass(pool.connection_class, SSLConnection)
        return cls(
            path=found.get("path"),
            host=found.get("host", "localhost"),
            port=int(found.get("port", 6379)),
            db=int(found.get("db", 0)),
            username=found.get("username"),
            password=found.get("password"),
            timeout_s=float(timeout),
            connect_timeout_s=float(found.get("socket_connect_timeout") or timeout),
            tls=Tls.of(found) if secure else None,
        )

    def __str__(self) -> str:
        return self.path if self.path is not None else f"{self.host}:{self.port}"


def pack(args: Sequence[Arg]) -> bytes:
    """One command as RESP: an array of bulk strings."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        else:
            data = arg.encode() if isinstance(arg, str) else repr(arg).encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


# An error answer's exception, by its first word (redis-py's mapping, and MISCONF's).
_error = cast(Callable[[str], Exception], ReplyParser.parse_error)


class _Incomplete(Exception):
    """The buffer ends within an answer: wait for more bytes."""


def _parse(buf: bytes, pos: int) -> tuple[Reply, int]:
    """The answer starting at `pos`, and where the next one starts."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos]
    if kind == 58:  # ':' an integer
        return int(buf[pos + 1 : end]), end + 2
    if kind == 36:  # '$' a bulk string, or nil
        size = int(buf[pos + 1 : end])
        if size < 0:
            return None, end + 2
        stop = end + 2 + size
        if len(buf) < stop + 2:
            raise _Incomplete
        return buf[end + 2 : stop], stop + 2
    if kind in {43, 45}:  # '+' a simple string, '-' an error
        line = buf[pos + 1 : end]
        return (line if kind == 43 else _error(line.decode(errors="replace"))), end + 2
    if kind == 42:  # '*' an array, or nil
        count = int(buf[pos + 1 : end])
        if count < 0:
            return None, end + 2
        items = []
        pos = end + 2
        for _ in range(count):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    raise ValueError(f"not a RESP2 answer: {buf[pos : pos + 20]!r}")


class _Connection(asyncio.Protocol):
    """One connection: its commands waiting for answers, oldest first, each with its
    deadline (they come in order, so only the oldest's needs a timer)."""

    def __init__(self, address: Address) -> None:
        self.address = address
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future[Reply]] = deque()
        self.deadlines: deque[float] = deque()
        self.buffer = b""
        # Commands sent in this turn of the loop, not written yet, with their deadlines.
        self.out: list[tuple[asyncio.Future[Reply], bytes, float]] = []
        self.failure: Exception | None = None
        self.timer: asyncio.TimerHandle | None = None

    def send(self, command: bytes) -> asyncio.Future[Reply]:
        """Queue a command; every command sent in one turn of the loop goes out in one write,
        but for those whose callers gave up before it."""
        future: asyncio.Future[Reply] = self.loop.create_future()
        if self.failure is not None:
            future.set_exception(type(self.failure)(*self.failure.args))
            return future
        if not self.out:
            self.loop.call_soon(self._flush)
        self.out.append((future, command, self.loop.time() + self.address.timeout_s))
        return future

    def close(self) -> None:
        self.fail(RedisConnectionError(f"the connection to Redis at {self.address} closed"))

    def fail(self, error: Exception, first: Exception | None = None) -> None:
        """Close the connection and fail every command on it: the oldest with `first` where
        given, the rest with `error`; later commands fail at once with `error`."""
        if self.failure is None:
            self.failure = error
        if self.transport is not None:
            # At once: nothing more is sent on a failed connection, and a TLS one's close
            # would wait for the server's goodbye.
            self.transport.abort()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.waiting.extend(future for future, _, _ in self.out)
        self.out.clear()
        self.deadlines.clear()
        while self.waiting:
            future = self.waiting.popleft()
            if not future.done():  # each its own exception: each is raised on its own way
                found = first or error
                future.set_exception(type(found)(*found.args))
            first = None

    def _flush(self) -> None:
        out, self.out = self.out, []
        if self.failure is not None:
            return
        commands = []
        for future, command, deadline in out:
            if not future.done():  # a caller that gave up already: its command is not sent
                self.waiting.append(future)
                self.deadlines.append(deadline)
                commands.append(command)
        if not commands:
            return
        assert self.transport is not None
        self.transport.write(commands[0] if len(commands) == 1 else b"".join(commands))
        if self.timer is None:
            self.timer = self.loop.call_at(self.deadlines[0], self._check_deadline)

    def _check_deadline(self) -> None:
        self.timer = None
        if not self.deadlines:
            return
        if self.deadlines[0] > self.loop.time():
            self.timer = self.loop.call_at(self.deadlines[0], self._check_deadline)
            return
        self.fail(
            RedisConnectionError(
                f"the connection to Redis at {self.address} was closed: a command before "
                "this one timed out"
            ),
            first=RedisTimeoutError(
                f"Redis at {self.address} did not answer in {self.address.timeout_s:g} s"
            ),
        )

    # asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        pos = 0
        try:
            while pos < len(buf):
                reply, pos = _parse(buf, pos)
                if not self.waiting:
                    raise ValueError("an answer to no command")
                future = self.waiting.popleft()
                self.deadlines.popleft()
                if future.done():  # its caller was cancelled: the answer is dropped
                    continue
                if isinstance(reply, Exception):  # an error answer
                    if isinstance(reply, ReadOnlyError):
                        self._demoted(future, reply)
                        return
                    future.set_exception(reply)
                else:
                    future.set_result(reply)
        except _Incomplete:
            pass
        except ValueError as exc:
            self.fail(RedisConnectionError(f"Redis at {self.address} broke the protocol: {exc}"))
            return
        self.buffer = buf[pos:] if pos < len(buf) else b""

    def _demoted(self, future: asyncio.Future[Reply], reply: ReadOnlyError) -> None:
        """Redis answered READONLY: it is a replica now (the Sentinels made another Redis
        the primary). The connection is lost to the pipe, as it is to redis-py's Sentinel
        pools, so the next command connects to the primary."""
        error = RedisConnectionError(
            f"Redis at {self.address} is a replica now ({reply}); the next command "
            "connects to the primary"
        )
        future.set_exception(error)
        self.fail(error)

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc is not None else ""
        self.fail(RedisConnectionError(f"Redis at {self.address} closed the connection{why}"))


class Pipe:
    """Commands to Redis on one shared connection, opened at the first command and again at
    the first after a failure."""

    def __init__(self, address: Address, locate: Locate | None = None) -> None:
        self.address = address
        # A replicated target's: where the primary is, asked at each connect (its host and
        # port replace the address's).
        self.locate = locate
        self._connection: _Connection | None = None
        # The connection is opened once for every command waiting for it.
        self._opening = Flight(self._connect)

    @classmethod
    def of(cls, client: aioredis.Redis) -> Pipe:
        """The pipe of `client`'s Redis, one for the client's pool: closing the client
        (`aclose`) closes it when the pool is a ClosingPool, as `redis_client` makes."""
        pool = client.connection_pool
        found = _PIPES.get(pool)
        if found is None:
            locate = _locator(pool) if isinstance(pool, SentinelConnectionPool) else None
            found = _PIPES[pool] = cls(Address.of(client), locate)
        return found

    async def execute(self, *args: Arg) -> Reply:
        """Send one command and wait for its answer."""
        connection = self._connection
        if connection is None or connection.failure is not None:
            connection = await self._opening.join()
        return await connection.send(pack(args))

    async def run(self, script: Script, keys: Sequence[Arg], args: Sequence[Arg]) -> Reply:
        """Run a Lua script by its SHA1, sending its source where Redis does not have it
        (a restart or SCRIPT FLUSH emptied its cache)."""
        try:
            return await self.execute(b"EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.execute(b"EVAL", script.source, len(keys), *keys, *args)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def leave(self, primary: tuple[str, int]) -> bool:
        """Fail the connection if it is to another Redis than `primary` (the Sentinels
        named another); whether it did. The next command connects to the primary."""
        connection = self._connection
        if connection is None or connection.failure is not None:
            return False
        address = connection.address
        if address.path is not None or (address.host, address.port) == primary:
            return False
        connection.fail(
            RedisConnectionError(f"Redis at {address} is no longer the primary; connect again")
        )
        return True

    async def _connect(self) -> _Connection:
        address = self.address
        if self.locate is not None:
            host, port = await self.locate()
            address = replace(address, host=host, port=port)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(address.connect_timeout_s):
                if address.path is not None:
                    _, connection = await loop.create_unix_connection(
                        lambda: _Connection(address), address.path
                    )
                else:
                    secure = None if address.tls is None else address.tls.context()
                    _, connection = await loop.create_connection(
                        lambda: _Connection(address),
                        address.host,
                        address.port,
                        ssl=secure,
                        server_hostname=None if secure is None else address.host,
                    )
        except TimeoutError:
            raise RedisTimeoutError(
                f"cannot connect to Redis at {address} in {address.connect_timeout_s:g} s"
            ) from None
        except OSError as exc:  # ssl.SSLError among them: a refused certificate
            raise RedisConnectionError(f"cannot connect to Redis at {address}: {exc}") from None
        hello: list[asyncio.Future[Reply]] = []
        if address.password is not None:
            login = [address.username] if address.username else []
            hello.append(connection.send(pack([b"AUTH", *login, address.password])))
        if address.db:
            hello.append(connection.send(pack([b"SELECT", address.db])))
        try:
            for answer in hello:
                await answer
        except BaseException:
            connection.close()
            raise
        self._connection = connection
        return connection


def _locator(pool: SentinelConnectionPool) -> Locate:
    """Where `pool`'s Sentinels say the primary is, without keeping the pool alive: the pipe
    is the pool's, kept by a weak reference to it."""
    held = weakref.ref(pool)

    async def locate() -> tuple[str, int]:
        found = held()
        if found is None:
            raise RedisConnectionError("the client this pipe belonged to was closed")
        host, port = await found.get_master_address()  # type: ignore[no-untyped-call]
        return str(host), int(port)

    return locate


def leave(pool: Any, primary: tuple[str, int]) -> bool:
    """`Pipe.leave` for the pipe of `pool`, if it has one."""
    found = _PIPES.get(pool)
    return found is not None and found.leave(primary)


# Each client pool's pipe; the pool going away takes its pipe along.
_PIPES: weakref.WeakKeyDictionary[Any, Pipe] = weakref.WeakKeyDictionary()


class ClosingPool(aioredis.BlockingConnectionPool):
    """redis-py's blocking pool, closing the pipe made of it (`Pipe.of`) when it closes its
    own connections, as a client's `aclose` does. Closing only the idle ones (a Sentinel
    pool does when the primary moved) leaves the pipe: it finds the primary itself."""

    async def disconnect(self, inuse_connections: bool = True) -> None:
        if inuse_connections:
            found = _PIPES.pop(self, None)
            if found is not None:
                found.close()
        await super().disconnect(inuse_connections)
