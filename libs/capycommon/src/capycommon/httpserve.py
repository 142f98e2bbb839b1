"""Serving an ASGI app over HTTP: a listening socket bound with a clear error when its port is
taken, and uvicorn serving the app on it (over TLS where given) until the service stops, each
connection held to the listener's limits (`capycommon.httpguard`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from email.utils import formatdate
from pathlib import Path
from typing import Any

import uvicorn

from capycommon.errors import ServicePortInUse
from capycommon.httpguard import Admit, disconnects_quiet, guarded_protocol
from capycommon.service import wait_any, wait_event
from capycommon.settings import ConnectionLimits
from capycommon.settingvalues import split_address

log = logging.getLogger(__name__)

# A listener's limits where no setting states them (the management API's).
DEFAULT_LIMITS = ConnectionLimits()

# With no connection open, uvicorn's tick waits this long at most (a connection wakes it).
IDLE_TICK_S = 60.0


class _Connections(set[Any]):
    """uvicorn's set of open connections, telling the server as each one opens."""

    def __init__(self, opened: Callable[[], None]) -> None:
        super().__init__()
        self._opened = opened

    def add(self, connection: Any) -> None:
        super().add(connection)
        self._opened()


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling (the service decides when to stop), and
    ticking once a second instead of ten times, and only while a connection is open: its tick
    refreshes the Date header (once a second either way) and notices the exit, which `leave`
    now wakes it for; an idle service should not wake for it. A connection that opens after
    a quiet spell refreshes the Date at once, before its first answer, and the tick resumes."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._leaving = asyncio.Event()
        self._opened = asyncio.Event()
        self._dated = 0.0
        self.server_state.connections = _Connections(self._on_open)

    def _on_open(self) -> None:
        if time.time() - self._dated >= 1.0:
            self._dated = time.time()
            date = formatdate(self._dated, usegmt=True).encode()
            found = [(b"date", date)] if self.config.date_header else []
            self.server_state.default_headers = found + self.config.encoded_headers
        self._opened.set()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def leave(self) -> None:
        self.should_exit = True
        self._leaving.set()

    async def main_loop(self) -> None:
        counter = 0  # in tenths of a second, as uvicorn counts: a multiple of 10 refreshes Date
        while not await self.on_tick(counter):
            self._dated = time.time()
            counter += 10
            if self.server_state.connections:
                await wait_event(self._leaving, 1.0)
            else:
                self._opened.clear()
                await wait_any(self._leaving, self._opened, timeout=IDLE_TICK_S)


def bind(address: str) -> socket.socket:
    """A listening TCP socket on `address`, or a clear error naming the port. It names its
    protocol: asyncio turns Nagle's algorithm off on the connections it accepts only then,
    and with it on, an answer written as head then body waits for the client's delayed ACK
    (up to 40 ms)."""
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServicePortInUse(
            f"cannot listen on {address}: {exc.strerror}; free the port or choose another",
            code=f"{ServicePortInUse.code}:{port}",
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve_http(
    app: Any,
    address: str,
    stop: asyncio.Event,
    limits: ConnectionLimits = DEFAULT_LIMITS,
    listener: socket.socket | None = None,
    tls: tuple[Path, Path] | ssl.SSLContext | None = None,
    admit: Admit | None = None,
) -> None:
    """Serve an ASGI app on `address` until `stop` is set, each connection held to `limits`;
    on `listener` where one is given (bound by a parent that shares it among its workers);
    over TLS with `tls`: a certificate file and its key file, or a server context of the
    caller's (which may require client certificates, and load a new certificate later for
    the connections that follow); serving only the connections `admit` admits."""
    sock = listener if listener is not None else bind(address)
    files = tls if isinstance(tls, tuple) else None
    context = tls if isinstance(tls, ssl.SSLContext) else None
    config = uvicorn.Config(
        disconnects_quiet(app),
        http=guarded_protocol(limits, admit),
        timeout_keep_alive=limits.keep_alive_timeout,
        log_config=None,
        access_log=False,
        # Nothing reads a request's client address, so none is taken from X-Forwarded-*
        # headers (uvicorn trusts them from loopback by default): a cost on every request.
        proxy_headers=False,
        lifespan="off",
        # A stop waits this long for requests in flight, then closes their connections.
        timeout_graceful_shutdown=10,
        ssl_certfile=None if files is None else str(files[0]),
        ssl_keyfile=None if files is None else str(files[1]),
        ssl_context_factory=None if context is None else (lambda _config, _default: context),
    )
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    log.info("listening", extra={"address": address})
    await asyncio.wait(
        [serving, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED
    )
    server.leave()
    await serving
    sock.close()
