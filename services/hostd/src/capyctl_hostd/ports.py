"""Leasing engine ports on 127.0.0.1 from the host's range, never stealing one."""

from __future__ import annotations

import socket

from capycommon.errors import PortsExhausted


def is_free(port: int) -> bool:
    """Whether nobody listens on or holds 127.0.0.1:port right now (a port in TIME_WAIT is
    free: engines bind with SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PortLeaser:
    def __init__(self, start: int, end: int) -> None:
        self.start = start
        self.end = end
        self.leased: set[int] = set()

    def lease(self) -> int:
        """The lowest port in the range that is neither leased nor held by anyone."""
        for port in range(self.start, self.end + 1):
            if port not in self.leased and is_free(port):
                self.leased.add(port)
                return port
        raise PortsExhausted(
            f"every engine port in {self.start}-{self.end} is leased or held by another "
            "process; widen host.engine_ports or free one"
        )

    def hold(self, port: int) -> None:
        """Mark a port in use by an engine adopted after a restart."""
        self.leased.add(port)

    def release(self, port: int | None) -> None:
        if port is not None:
            self.leased.discard(port)
