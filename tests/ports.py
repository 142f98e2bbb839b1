"""The ports tests give the processes they start: each test process (a pytest-xdist worker,
or a whole run without workers) holds a block of its own, below the kernel's ephemeral ports
(32768 and up), so no connection's local port, no other worker and no other run of the suite
on the machine is ever handed the same port.

A block is held by a lock on a file in the temporary folder for as long as the process lives:
two copies of the suite side by side take different blocks."""

from __future__ import annotations

import fcntl
import functools
import itertools
import socket
import tempfile
from pathlib import Path
from typing import IO

BLOCKS = 8
# A thousand listener ports a block, 10000 to 17999.
LISTENER_BASE = 10_000
# Twelve engine ranges of a hundred ports a block (1200 a block), 18000 to 27599.
ENGINE_BASE = 18_000
ENGINE_RANGES = 12

_held: list[IO[str]] = []
_next = itertools.count()


@functools.cache
def block() -> int:
    """This process's block: the first whose lock file no other process holds."""
    for number in range(BLOCKS):
        lock = (Path(tempfile.gettempdir()) / f"capyctl-test-ports.{number}.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        _held.append(lock)  # kept open: the lock lasts as long as this process
        return number
    raise AssertionError(f"all {BLOCKS} blocks of test ports are held by other test processes")


def reserved_port(host: str = "127.0.0.1") -> socket.socket:
    """A port held for a process the test starts: a socket bound to it and never listening,
    which the process, binding it with SO_REUSEADDR or SO_REUSEPORT as engines, the
    simulator, uvicorn and ZMQ do, still can. Its port is `getsockname()[1]`; close it once
    the process is gone.

    The port is one of this process's block: a holder that allows reuse would let any other
    process's bind to port 0 with SO_REUSEADDR (asyncio's and uvicorn's servers set it) be
    given the same port and listen on it first. Each port is taken only after an exclusive
    bind shows nothing holds it, lingering connections of an earlier test included."""
    return _hold(host, _unheld(host))


def reserved_everywhere(hosts: tuple[str, ...]) -> list[socket.socket]:
    """One port held on each of `hosts`, the same port on all (as `reserved_port` holds
    it): for processes on several loopback addresses that share a port number, as
    replicated servers do. Close the sockets once the processes are gone."""
    for _ in range(100):
        port = _unheld(hosts[0])
        if not all(_free(host, port) for host in hosts[1:]):
            continue
        return [_hold(host, port) for host in hosts]
    raise AssertionError(f"no port of this block is free on all of {hosts}")


def _free(host: str, port: int) -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, port))
    except OSError:
        return False
    return True


def _hold(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A port of this process's block that nothing holds now, for a process the test starts
    to listen on: no one else is handed a port of the block, so it is still free when that
    process binds it."""
    return _unheld(host)


def _unheld(host: str) -> int:
    first = LISTENER_BASE + 1000 * block()
    for _ in range(1000):
        port = first + next(_next) % 1000
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                probe.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError(f"no free port in {first} and the 999 after")


def engine_ports(index: int = 0) -> str:
    """Engine port range `index` (0 to 11) of this process's block, for hostd to lease:
    engines bind their ports with SO_REUSEPORT, and the kernel would split one port's
    connections between two. A test that runs several hosts at once gives each its own."""
    if not 0 <= index < ENGINE_RANGES:
        raise ValueError(f"engine range {index}: there are {ENGINE_RANGES}, 0 to 11")
    start = ENGINE_BASE + 100 * (ENGINE_RANGES * block() + index)
    return f"{start}-{start + 99}"
