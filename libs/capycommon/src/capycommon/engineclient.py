"""The client to engines: HTTP/1.1 POSTs on kept-alive connections, for the router (to the
engines on its own host, and to the ingresses of joined hosts) and for a host's ingress (to
the engines behind it).

A general HTTP client (httpx, with httpcore, anyio and h11 beneath it) cost more CPU per
request than everything else the router does (bench/router.py), and made a short request
cost a host's ingress three to four times the CPU it costs with a client like this one, TLS
included. Both need little of it: one kind of request, to addresses they know, one request
at a time on a connection. So this is an asyncio protocol with httptools' parser (llhttp, as
uvicorn's faster path uses) and a pool of idle connections per address: plain TCP to engines
on loopback, TLS to the ingresses of joined hosts, each checked once, after its handshake,
to be the host's it was meant for (`Ingress.refusal`).

An answer is read as it arrives; closing one before its end closes its connection, which is
how an engine learns at once that a client left. One read to its end gives the connection
back to the pool, where it waits at most `keepalive_s` (less than the engines' own 5 s, so a
request is never sent on a connection the engine is closing).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Mapping
from typing import Protocol, cast

import httptools

# An answer's body is buffered up to this much before the engine's connection stops being
# read, until its reader takes it.
HIGH_WATER = 1 << 20
# Idle connections kept to one engine; more are closed as their answers end.
MAX_IDLE = 64


class Ingress(Protocol):
    """A joined host's ingress as the client dials it (the router's `remote.Ingress`, one
    pool of connections per value): where it listens, its Host header, and what is wrong
    with the certificate it presented on a connection, None when it is the host's own."""

    @property
    def address(self) -> str: ...  # an IP address or a DNS name

    @property
    def port(self) -> int: ...

    @property
    def authority(self) -> str: ...

    def refusal(self, transport: asyncio.BaseTransport) -> str | None: ...


# An idle connection's pool: a loopback engine's (address, port), or a joined host's ingress.
Key = tuple[str, int] | Ingress


class EngineConnectionError(Exception):
    """The engine's connection failed: refused, reset, closed mid-answer, or not HTTP."""


class IngressUnreachable(EngineConnectionError):
    """No connection to a joined host's ingress: refused, timed out, its TLS handshake
    failed, or the certificate it presented is not the host's."""


class Answer:
    """One engine answer: its status and headers, then its body as it arrives."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._complete = False
        self._error: EngineConnectionError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._closed = False

    async def head(self) -> None:
        """Wait for the answer's status and headers (closing it if that fails)."""
        try:
            await self._head
        except BaseException:
            self.close()
            raise

    @property
    def over(self) -> bool:
        """Whether nothing more will arrive: the body ended, or the connection failed."""
        return self._complete or self._error is not None

    def take(self) -> bytes:
        """What arrived of the body and was not taken yet, without waiting (b"" if none)."""
        if not self._chunks:
            return b""
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        self._connection.resume()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def receive(self, until: float | None = None) -> bytes:
        """What arrived of the body since the last call, waiting for some (TimeoutError if
        none came by `until`, in time.monotonic); b"" at its end. Only a wait arms a timer:
        most calls find their bytes already there."""
        while not self._chunks:
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            loop = asyncio.get_running_loop()
            self._waiter = waiter = loop.create_future()
            delay = None if until is None else until - time.monotonic()
            timer = None if delay is None else loop.call_later(delay, _expire, waiter)
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        return self.take()

    async def read(self, limit: int) -> bytes:
        """The body, or its first `limit` bytes when it is longer (the rest is not read)."""
        found = bytearray()
        while len(found) < limit and (chunk := await self.receive()):
            found += chunk
        return bytes(found[:limit])

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool if the answer was read
        to its end, else it is closed (the engine sees the request abandoned)."""
        if self._closed:
            return
        self._closed = True
        self._connection.finished(self._complete and self._error is None)

    # Called by the connection ----------------------------------------------------------------

    def _headers_done(self, status: int) -> None:
        self.status = status
        if not self._head.done():
            self._head.set_result(None)

    def _body(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        if self._buffered >= HIGH_WATER:
            self._connection.pause()
        self._wake()

    def _end(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: EngineConnectionError) -> None:
        if self._complete:
            return
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Connection(asyncio.Protocol):
    """One connection to an engine, with the answer it is reading, if any."""

    def __init__(self, pool: Engines, key: Key, authority: str) -> None:
        self.pool = pool
        self.key = key
        self.authority = authority  # host:port, for the Host header
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: Answer | None = None
        self.idle_since = 0.0
        self.lost = False
        self._keep_alive = False
        self._paused = False

    def post(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        content_type: str = "application/json",
    ) -> Answer:
        """Send the request, at once (before anything is waited for); its answer, whose
        status and headers `Answer.head` waits for."""
        assert self.transport is not None
        head = [
            f"POST {path} HTTP/1.1",
            f"Host: {self.authority}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
        ]
        head += [f"{name}: {value}" for name, value in headers.items()]
        self.answer = Answer(self)
        self.parser = httptools.HttpResponseParser(self)
        self.transport.write("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)
        return self.answer

    def finished(self, reusable: bool) -> None:
        self.answer = None
        self.resume()
        if reusable and self._keep_alive and not self.lost:
            self.idle_since = time.monotonic()
            self.pool.give_back(self)
        else:
            self.close()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()

    # asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if self.answer is None:  # nothing was asked: an engine that talks out of turn
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.answer._fail(EngineConnectionError(f"the engine's answer is not HTTP ({exc})"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.pool.forget(self)
        if self.answer is not None:
            why = f": {exc}" if exc is not None else ""
            self.answer._fail(EngineConnectionError(f"the engine closed the connection{why}"))

    # httptools' callbacks ------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.answer is not None:
            self.answer.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._keep_alive = self.parser.should_keep_alive()
        if self.answer is not None:
            self.answer._headers_done(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.answer is not None:
            self.answer._body(body)

    def on_message_complete(self) -> None:
        self._keep_alive = self.parser.should_keep_alive()
        if self.answer is not None:
            self.answer._end()


class Engines:
    """Connections to engines, kept between requests; one request at a time on each."""

    def __init__(
        self,
        keepalive_s: float = 2.0,
        connect_timeout_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        # The client context for the hosts' ingresses: a server role's router's. None for
        # the other clients (a standalone role's router, a host's ingress), whose engines
        # are all on loopback.
        self.tls = tls
        self._idle: dict[Key, list[Connection]] = {}

    async def post(
        self,
        host: str,
        port: int,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        content_type: str = "application/json",
    ) -> Answer:
        """Send the request to the engine at `host`:`port`; its answer once its status and
        headers arrived. The caller closes it."""
        answer = (await self.connect(host, port)).post(path, body, headers, content_type)
        await answer.head()
        return answer

    async def connect(self, host: str, port: int) -> Connection:
        """A connection to the engine at `host`:`port`: an idle one, else a new one."""
        return self._idle_connection((host, port)) or await self._connect(host, port)

    async def connect_ingress(self, ingress: Ingress) -> Connection:
        """A connection to a joined host's ingress: an idle one, else a new one over TLS
        whose peer presented the host's own certificate (IngressUnreachable otherwise)."""
        return self._idle_connection(ingress) or await self._connect_tls(ingress)

    def _idle_connection(self, key: Key) -> Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if not connection.lost and now - connection.idle_since < self.keepalive_s:
                return connection
            connection.close()
        return None

    async def _connect(self, host: str, port: int) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: Connection(self, (host, port), f"{host}:{port}"), host, port
                )
        except (OSError, TimeoutError) as exc:
            raise EngineConnectionError(
                f"cannot connect to the engine at {host}:{port} ({exc or 'timed out'})"
            ) from None
        return connection

    async def _connect_tls(self, ingress: Ingress) -> Connection:
        if self.tls is None:
            raise IngressUnreachable(
                f"cannot connect to {ingress}: this router has no client certificate (only a "
                "server role's router reaches joined hosts)"
            )
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):  # the handshake included
                transport, connection = await loop.create_connection(
                    lambda: Connection(self, ingress, ingress.authority),
                    ingress.address,
                    ingress.port,
                    ssl=self.tls,
                    server_hostname=ingress.address,  # SNI for a name; none for an address
                )
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise IngressUnreachable(
                f"cannot connect to {ingress} ({exc or 'timed out'})"
            ) from None
        problem = ingress.refusal(transport)
        if problem is not None:
            connection.close()
            raise IngressUnreachable(f"refused {ingress}: {problem}")
        return connection

    def give_back(self, connection: Connection) -> None:
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) < MAX_IDLE:
            idle.append(connection)
        else:
            connection.close()

    def forget(self, connection: Connection) -> None:
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
