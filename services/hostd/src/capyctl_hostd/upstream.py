"""The ingress's client to this host's engines: HTTP/1.1 POSTs on kept-alive loopback
connections.

A general HTTP client (httpx, with httpcore, anyio and h11 beneath it) took more of the
ingress's CPU than the rest of its work, TLS included: a short request cost the ingress
three to four times the CPU it costs with this client. The ingress needs little of it: one
kind of request, to ports it knows, one request at a time on a connection. So this is
asyncio's streams (whose reader pauses the engine's connection while the router reads slower
than the engine writes) with httptools' parser, as uvicorn's own faster path, and a pool of
idle connections per port.

An answer's body is read as it arrives. An answer closed before its end closes its
connection, which is how an engine learns at once that its client left; one read to its end
gives the connection back to the pool, where it waits at most `keepalive_s` (less than the
engines' own 5 s, so a request never goes out on a connection the engine is closing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import httptools

# What one read of an engine's connection takes at most.
READ_SIZE = 1 << 16
# Idle connections kept to one engine; more are closed as their answers end.
MAX_IDLE = 64


class EngineConnectionError(Exception):
    """The engine's connection failed: refused, reset, closed mid-answer, or not HTTP."""


@dataclass
class _Link:
    """One connection to an engine."""

    port: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def close(self) -> None:
        self.writer.close()


@dataclass
class _Parsed:
    """httptools' callbacks for one answer: what arrived of it so far, and whether its
    connection may serve another request (known only while the parser is at the answer's
    end: it starts on the next one after)."""

    parser: httptools.HttpResponseParser | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    head_done: bool = False
    complete: bool = False
    keep_alive: bool = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser is not None and self.parser.should_keep_alive()


class Answer:
    """One engine's answer: its status and headers, then its body as it arrives (`chunks`).
    `close` when done with it, read to its end or not."""

    def __init__(self, engines: Engines, link: _Link) -> None:
        self._engines = engines
        self._link = link
        self._parsed = _Parsed()
        self._parser = self._parsed.parser = httptools.HttpResponseParser(self._parsed)
        self._closed = False
        self.status = 0

    @property
    def headers(self) -> dict[str, str]:
        """The answer's headers, by lower-case name."""
        return self._parsed.headers

    async def head(self) -> None:
        """Wait for the status and the headers."""
        while not self._parsed.head_done:
            await self._read()
        self.status = self._parser.get_status_code()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, as it arrives; EngineConnectionError if it ends short."""
        parsed = self._parsed
        while True:
            if parsed.body:
                found = parsed.body[0] if len(parsed.body) == 1 else b"".join(parsed.body)
                parsed.body.clear()
                yield found
            if parsed.complete:
                return
            await self._read()

    def close(self) -> None:
        """Done with the answer: its connection goes back to the pool if the answer was read
        to its end, else it is closed (the engine sees the request abandoned)."""
        if self._closed:
            return
        self._closed = True
        if self._parsed.complete and self._parsed.keep_alive:
            self._engines.give_back(self._link)
        else:
            self._link.close()

    async def _read(self) -> None:
        try:
            data = await self._link.reader.read(READ_SIZE)
        except OSError as exc:
            raise EngineConnectionError(f"the engine's connection failed ({exc})") from None
        if not data:
            raise EngineConnectionError("the engine closed the connection before its answer ended")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise EngineConnectionError(f"the engine's answer is not HTTP ({exc})") from None


class Engines:
    """Connections to the engines on loopback, kept between requests; one request at a time
    on each."""

    def __init__(self, keepalive_s: float = 2.0, connect_timeout_s: float = 10.0) -> None:
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[int, list[_Link]] = {}

    async def post(self, port: int, path: str, headers: Mapping[str, str], body: bytes) -> Answer:
        """Send the request to the engine on 127.0.0.1:`port`; its answer once its status
        and headers arrived. The caller closes it."""
        link = self._idle_link(port) or await self._connect(port)
        head = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Length: {len(body)}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        answer = Answer(self, link)
        try:
            link.writer.write("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)
            await link.writer.drain()
            await answer.head()
        except OSError as exc:
            answer.close()
            raise EngineConnectionError(f"the engine's connection failed ({exc})") from None
        except BaseException:
            answer.close()
            raise
        return answer

    def give_back(self, link: _Link) -> None:
        idle = self._idle.setdefault(link.port, [])
        if len(idle) < MAX_IDLE and not link.writer.is_closing():
            link.idle_since = time.monotonic()
            idle.append(link)
        else:
            link.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for link in idle:
                link.close()
        self._idle.clear()

    def _idle_link(self, port: int) -> _Link | None:
        idle = self._idle.get(port)
        now = time.monotonic()
        while idle:
            link = idle.pop()
            if now - link.idle_since < self.keepalive_s and not link.reader.at_eof():
                return link
            link.close()
        return None

    async def _connect(self, port: int) -> _Link:
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=READ_SIZE)
        except (OSError, TimeoutError) as exc:
            raise EngineConnectionError(
                f"cannot connect to the engine on port {port} ({exc or 'timed out'})"
            ) from None
        return _Link(port, reader, writer)
