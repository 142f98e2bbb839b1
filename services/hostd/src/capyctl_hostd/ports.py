"""Leasing engine ports on 127.0.0.1 from the host's range, never stealing one, and holding
each leased port until its engine (or LMCache server) is done with it.

A lease is a socket bound to the port and never listening, bound with no option at all: the
bind fails wherever another socket has the port (another hostd's lease, a listener, a
connection in TIME_WAIT, which the lease then passes over), so two hostds on one machine
never lease one port. SO_REUSEADDR and SO_REUSEPORT are set only after the bind, so that the
engine's own bind still succeeds beside it, as every engine binds with SO_REUSEADDR (vLLM,
SGLang's uvicorn, LMCache's servers and ZMQ) or SO_REUSEPORT (llama.cpp's HTTP library): a
socket that is not listening lets a socket bound with SO_REUSEADDR listen beside it, and one
of the same user bound with SO_REUSEPORT. (So may another process that binds that very port
with one of them; once the engine listens, only one with SO_REUSEPORT, which
`procs.foreign_listeners` finds.)
"""

from __future__ import annotations

import socket

from capycommon.errors import PortsExhausted

HOST = "127.0.0.1"


def is_free(port: int) -> bool:
    """Whether nobody listens on or holds 127.0.0.1:port right now (a port in TIME_WAIT is
    free: engines bind with SO_REUSEADDR)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((HOST, port))
    except OSError:
        return False
    finally:
        sock.close()
    return True


def hold(port: int) -> socket.socket | None:
    """127.0.0.1:port held for an engine to come, or None when any other socket has it. The
    bind, with no option, is the test (see the module's docstring); the options set after it
    let the engine bind beside the lease."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, port))
    except OSError:
        sock.close()
        return None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    return sock


class PortLeaser:
    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        # Each port leased, with the socket that holds it (None: an adopted engine's, which
        # its engine holds itself).
        self.leased: dict[int, socket.socket | None] = {}

    def lease(self) -> int:
        """The lowest port in the range that is neither leased nor held by anyone, held from
        now until it is released."""
        for port in range(self.start, self.end + 1):
            if port in self.leased:
                continue
            held = hold(port)
            if held is not None:
                self.leased[port] = held
                return port
        raise PortsExhausted(
            f"every engine port in {self.start}-{self.end} is leased or held by another "
            "process; widen host.engine_ports or free one"
        )

    def hold(self, port: int) -> None:
        """Mark a port in use by an engine adopted after a restart."""
        self.leased.setdefault(port, None)

    def release(self, port: int | None) -> None:
        if port is None:
            return
        held = self.leased.pop(port, None)
        if held is not None:
            held.close()
