"""What a listener guards against that uvicorn leaves open: connections that never finish
their request head, and one client piling up connections; and clients that leave. And how it
writes: uvicorn's fast protocol (httptools' parser), its writes of one turn of the event loop
sent together (`CorkedTransport`).

uvicorn closes a connection idle between requests (its keep-alive timeout), but not one that
was opened and left silent, nor one that sends its head a byte at a time: each holds a file
descriptor for as long as the client likes. Its only bound on connections is global (503 to
everyone past it). `guarded_protocol` adds both at the protocol level, below the app: a
connection whose request head is not complete within the header timeout (counted from the
connection's opening, or from the first byte of its next request) is closed, and a
connection from an address that already holds its bound is answered 503 and closed. A
connection whose answer went out before its request's body ended (the app refused it, or
read none of it) is closed too: uvicorn would read the rest for as long as it came, each
byte putting its keep-alive timeout off again.

A listener may also admit its peers one by one (`Admit`): over mutual TLS, a connection whose
peer is not of the kind the listener serves is closed as it opens, before any of its bytes
is read, and the refusal is logged.

A client that hangs up while sending its request body is an ordinary event: the protocol
logs it as one line, and `disconnects_quiet` keeps the app's meeting it (starlette's
ClientDisconnect) from being logged by uvicorn as a failure with its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, cast

from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from capycommon.errors import Unavailable

if TYPE_CHECKING:  # the settings tree is heavy to import, and the simulated engines need none
    from capycommon.settings import ConnectionLimits

log = logging.getLogger(__name__)

# Whether a listener serves a new connection: None when it does, else why not (for the log).
Admit = Callable[[asyncio.Transport], str | None]


class CorkedTransport:
    """A connection's transport that gathers the writes of one turn of the event loop and
    sends them as one: an answer's head and body, or a stream's events and its end, leave in
    one system call (and wake the client once) instead of one each."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._parts: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self._parts:
            asyncio.get_running_loop().call_soon(self._flush)
        self._parts.append(bytes(data))

    def _flush(self) -> None:
        if self._parts:
            data = b"".join(self._parts)
            self._parts.clear()
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class ServerGuard:
    """What one server's connections are held to: its limits, whom it admits, and its
    connections per client address against their bound (a connection over it is answered
    `refusal`, and its address is logged once until it drops below)."""

    def __init__(self, limits: ConnectionLimits, admit: Admit | None) -> None:
        self.limits = limits
        self.admit = admit
        self.refusal = _refusal(limits.connections_per_client)
        self.held: Counter[str] = Counter()
        # Addresses at their bound that were told so in the log (once until they drop below).
        self.warned: set[str] = set()

    def take(self, peer: str) -> bool:
        """Count one more connection of `peer`; False (nothing counted) at its bound."""
        if self.held[peer] < self.limits.connections_per_client:
            self.held[peer] += 1
            return True
        if peer not in self.warned:
            self.warned.add(peer)
            log.warning("client %s holds %d connections, its bound", peer, self.held[peer])
        return False

    def give(self, peer: str) -> None:
        """One connection of `peer` closed."""
        self.held[peer] -= 1
        if self.held[peer] < self.limits.connections_per_client:
            self.warned.discard(peer)
        if not self.held[peer]:
            del self.held[peer]


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's HTTP/1.1 protocol (httptools) held to its server's `guard` (a header timeout,
    a bound per client address, whom it admits), writing through a `CorkedTransport`."""

    guard: ClassVar[ServerGuard]
    _head_timer: asyncio.TimerHandle | None = None
    _counted: str | None = None
    _refused = False
    _keep_alive_once_read = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream's, over TLS or not (uvloop's are not asyncio.Transport subclasses).
        transport = cast(asyncio.Transport, transport)
        super().connection_made(cast(asyncio.Transport, CorkedTransport(transport)))
        why = None if self.guard.admit is None else self.guard.admit(transport)
        if why is not None:
            self._refused = True
            log.warning("refused a connection from %s: %s", _address(self.client), why)
            transport.close()
            return
        peer = self.client[0] if self.client else ""
        if self.guard.take(peer):
            self._counted = peer
        else:
            self.app = self.guard.refusal
        self._await_head()

    def data_received(self, data: bytes) -> None:
        if not self._refused:  # a refused connection's bytes are never read
            super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._await_head()  # a kept-alive connection's next head has begun

    def on_headers_complete(self) -> None:
        self._head_done()
        super().on_headers_complete()
        # Until the body has all come, an answer says the connection closes (uvicorn writes
        # `Connection: close` for a cycle not kept alive): a connection answered before its
        # body ended is closed (`on_response_complete`), and a client told so never sends
        # its next request on it.
        cycle = self.cycle
        if cycle is not None and cycle.keep_alive and not cycle.response_complete:
            cycle.keep_alive = False
            self._keep_alive_once_read = True

    def on_message_complete(self) -> None:
        super().on_message_complete()
        cycle = self.cycle
        if self._keep_alive_once_read and cycle is not None and not cycle.response_started:
            cycle.keep_alive = True
        self._keep_alive_once_read = False

    def shutdown(self) -> None:
        self._keep_alive_once_read = False  # a stopping server keeps no connection
        super().shutdown()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not self.transport.is_closing():
            # Answered before its body all came (a refusal, a route that reads none):
            # the rest is not waited for, however slowly it comes.
            log.debug("closing a connection answered before its request body ended")
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        if cycle is not None and cycle.more_body and not cycle.response_complete:
            log.info(
                "client %s left while sending its request: %s %s",
                _address(self.client),
                cycle.scope["method"],
                cycle.scope["path"],
            )
        super().connection_lost(exc)
        self._head_done()
        peer, self._counted = self._counted, None
        if peer is not None:
            self.guard.give(peer)

    def _await_head(self) -> None:
        if self._head_timer is None:
            timeout = self.guard.limits.header_timeout
            self._head_timer = self.loop.call_later(timeout, self._head_late)

    def _head_done(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None  # the head's end would have cancelled it
        if not self.transport.is_closing():
            log.debug("closing a connection whose request head took too long")
            self.transport.close()


def guarded_protocol(
    limits: ConnectionLimits, admit: Admit | None = None
) -> type[HttpToolsProtocol]:
    """`GuardedProtocol` for one server (the connections it counts are that server's); with
    `admit`, only the connections it admits are served."""

    class Guarded(GuardedProtocol):
        guard = ServerGuard(limits, admit)

    return Guarded


def _refusal(bound: int) -> ASGIApp:
    """The answer to a connection over its client's bound: 503 in the OpenAI envelope."""
    error = Unavailable(
        f"this client holds {bound} connections, the most one client may; reuse them or "
        "close some, then retry"
    )
    body = json.dumps(
        {
            "error": {
                "message": error.message,
                "type": "server_error",
                "param": None,
                "code": error.code,
            }
        }
    ).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": error.http_status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return refuse


def disconnects_quiet(app: ASGIApp) -> ASGIApp:
    """`app`, ending quietly when its client left before its body was read: the listener
    logs that in one line, where uvicorn would log the app's frames as a failure."""

    async def quiet(scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(ClientDisconnect):
            await app(scope, receive, send)

    return quiet


def _address(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "unknown"
