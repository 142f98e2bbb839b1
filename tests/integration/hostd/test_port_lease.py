"""hostd's engine ports: a leased port is held until released, so no other process binds it
meanwhile, while the engine it is leased for binds and listens on it, whether with
SO_REUSEADDR (vLLM, SGLang, LMCache) or SO_REUSEPORT alone; a port another process listens
on, or another hostd holds, is never leased."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from capycommon.errors import PortsExhausted
from capyctl_hostd.ports import PortLeaser, is_free
from ports import engine_ports


@contextmanager
def listening(port: int, reuse_address: bool, reuse_port: bool) -> Iterator[socket.socket]:
    """An engine's listener on 127.0.0.1:port, bound with the options given."""
    with socket.socket() as sock:
        if reuse_address:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield sock


def leaser() -> PortLeaser:
    # Ports of this test process's own, below the kernel's ephemeral ones.
    start, _, end = engine_ports(7).partition("-")
    return PortLeaser(int(start), int(end))


@pytest.mark.parametrize(
    ("reuse_address", "reuse_port"),
    [(True, False), (False, True), (True, True)],
    ids=["reuseaddr", "reuseport", "both"],
)
def test_a_leased_port_is_held_for_its_engine_alone(reuse_address: bool, reuse_port: bool) -> None:
    ports = leaser()
    leased = ports.lease()
    try:
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("127.0.0.1", leased))
        other_lease = ports.lease()
        ports.release(other_lease)
        assert other_lease != leased, "nor is it leased twice"
        with listening(leased, reuse_address, reuse_port) as engine:
            assert engine.getsockname()[1] == leased
            with socket.socket() as other:
                other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError, match="in use"):
                    other.bind(("127.0.0.1", leased))
    finally:
        ports.release(leased)
    assert is_free(leased), "free again once released"


def test_a_port_another_process_listens_on_is_never_leased() -> None:
    ports = leaser()
    first = ports.lease()
    ports.release(first)
    # A live engine of this user on it (SO_REUSEPORT too), that hostd does not know of.
    with listening(first, reuse_address=True, reuse_port=True):
        second = ports.lease()
        assert second != first
        ports.release(second)


def test_every_port_leased_is_a_clear_error() -> None:
    ports = leaser()
    one = PortLeaser(ports.start, ports.start)
    held = one.lease()
    with pytest.raises(PortsExhausted, match=r"widen host\.engine_ports"):
        one.lease()
    one.release(held)
    one.hold(held)  # an adopted engine's port: leased, with nothing held for it
    with pytest.raises(PortsExhausted):
        one.lease()


def test_two_hostds_on_one_machine_never_lease_one_port() -> None:
    # Two roles on one machine whose ranges overlap: each lease is passed over by the other.
    mine, theirs = leaser(), leaser()
    held = mine.lease()
    try:
        other = theirs.lease()
        theirs.release(other)
        assert other != held, "a port another hostd holds is not leased again"
    finally:
        mine.release(held)
