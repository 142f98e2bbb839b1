"""The life of one simulated engine process: signals, the listening socket, serving, exits.

SIGTERM or SIGINT sets `Process.stop` at any phase: while loading the engine exits 0 at once;
while serving it stops accepting, lets the family finish or abort what runs, and exits 0.
Every exit that Python sees (clean or a simulated crash) runs the clean-ups: the memory
claim, the EngineCore child, the /dev/shm segment. SIGKILL runs nothing, as for the real one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable
from typing import Any, NoReturn, TypeVar, cast

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from capycommon.httpguard import CorkedTransport

log = logging.getLogger("enginesim")

Args = TypeVar("Args")


class Process:
    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.stopping = False
        self._cleanups: list[Callable[[], None]] = []
        self._tasks: set[asyncio.Task[Any]] = set()

    def at_exit(self, cleanup: Callable[[], None]) -> None:
        self._cleanups.append(cleanup)

    def cleanup(self) -> None:
        while self._cleanups:
            with contextlib.suppress(OSError):
                self._cleanups.pop()()

    def die(self, message: str, code: int = 1) -> NoReturn:
        """A crash as the engine shows it: the message on stderr, then a non-zero exit."""
        sys.stdout.flush()
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stderr.flush()
        self.cleanup()
        os._exit(code)

    def spawn(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def later(self, seconds: float, action: Callable[[], object]) -> None:
        async def run() -> None:
            await asyncio.sleep(seconds)
            action()

        self.spawn(run())

    async def pause(self, seconds: float) -> bool:
        """Sleep `seconds` unless told to stop; True when told to stop."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            return False
        return True


def run(main: Callable[[Process], Awaitable[int]]) -> int:
    """Run a family's `main` in a fresh event loop with the signals routed to `stop`."""

    async def body() -> int:
        process = Process()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, process.stop.set)
        try:
            return await main(process)
        finally:
            process.cleanup()

    return asyncio.run(body())


def open_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """Bound but not listening: a client is refused until `serve` starts (as vLLM loads).

    Made with the TCP protocol named, so asyncio turns Nagle's algorithm off on every
    connection it accepts (it checks `sock.proto`): otherwise an answer written in two parts
    (head, then body) waits up to 40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


class _CorkedH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol writing through a `CorkedTransport`."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        corked = CorkedTransport(cast(asyncio.Transport, transport))
        super().connection_made(cast(asyncio.Transport, corked))


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `Process.stop` decides when to shut down."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def serve(
    app: Any,
    sock: socket.socket,
    process: Process,
    on_stop: Callable[[], Awaitable[None]],
    access_log: bool = True,
    corked: bool = False,
) -> None:
    """Listen on `sock` and serve `app` until `process.stop`; `on_stop` runs first then.
    `corked` sends the writes of each turn of the event loop together (instant engines)."""
    config = uvicorn.Config(
        app,
        http=_CorkedH11 if corked else "auto",
        log_config=None,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=5,
        timeout_keep_alive=5,
    )
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    stopping = asyncio.create_task(process.stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stopping.done():
        process.stopping = True
        await on_stop()
        server.should_exit = True
    else:
        stopping.cancel()
    await serving


def configure_logging(fmt: str, stream: Any, datefmt: str = "%m-%d %H:%M:%S") -> None:
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(fmt, datefmt=datefmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)


def accept_flags(
    parser: argparse.ArgumentParser, switches: Iterable[str], values: Iterable[str]
) -> None:
    """Add each switch (a flag without a value), then each flag that takes a value; "|" joins
    a flag's aliases."""
    for switch in switches:
        parser.add_argument(*switch.split("|"), action="store_true")
    for flag in values:
        parser.add_argument(*flag.split("|"))


def as_parsed(args: type[Args], ns: argparse.Namespace, **derived: Any) -> Args:
    """The dataclass `args` of a command line: each field the flag of the same name's value as
    parsed, but those given in `derived`, which the family reads from more than one flag."""
    names = [f.name for f in dataclasses.fields(cast(Any, args)) if f.name not in derived]
    return args(**{name: getattr(ns, name) for name in names}, **derived)
