"""A second listener on an engine's port is seen (engines bind with SO_REUSEPORT, so the
kernel would let both listen and split the connections)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from capycommon import procfs
from capyctl_hostd import procs
from support import wait_for

LISTENER = """
import signal, socket, sys
sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen()
print("listening", flush=True)
signal.pause()  # until the test ends it
"""


def _reuse_port_socket(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


@contextmanager
def _engine_listening(port: int, listeners: int) -> Iterator[subprocess.Popen[bytes]]:
    """An engine stand-in listening on `port` (with SO_REUSEPORT) in a session of its own,
    once /proc/net/tcp shows `listeners` listeners there; killed on the way out."""
    engine = subprocess.Popen(
        [sys.executable, "-c", LISTENER, str(port)],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert engine.stdout is not None
        assert engine.stdout.readline() == b"listening\n"
        wait_for(
            lambda: len(procfs.listening_inodes(port)) == listeners,
            timeout=5,
            what=f"{listeners} listener(s) in /proc/net/tcp",
        )
        yield engine
    finally:
        os.killpg(engine.pid, signal.SIGKILL)
        engine.wait()
        engine.stdout.close()  # type: ignore[union-attr]


def test_a_foreign_listener_on_the_engines_port_is_found() -> None:
    with _reuse_port_socket() as ours:
        port = ours.getsockname()[1]
        with _engine_listening(port, listeners=2) as engine:
            foreign = procs.foreign_listeners(port, engine.pid)
            assert foreign == procfs.socket_inodes([os.getpid()]) & procfs.listening_inodes(port)
            assert len(foreign) == 1, "this test's socket is the foreign one"
    assert procs.foreign_listeners(port, engine.pid) == set(), "nobody listens any more"


def test_an_engine_alone_on_its_port_has_no_foreign_listener() -> None:
    with _reuse_port_socket() as probe:
        port = probe.getsockname()[1]
    with _engine_listening(port, listeners=1) as engine:
        assert procs.foreign_listeners(port, engine.pid) == set()


def test_listeners_are_read_from_proc_net_tcp(tmp_path: Path) -> None:
    net = tmp_path / "net"
    net.mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    v4 = (
        "   0: 0100007F:1FA4 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0 0 111 1\n"
        "   1: 0100007F:1FA4 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000  0 0 222 1\n"
        "   2: 0100007F:1FA5 00000000:0000 0A 00000000:00000000 00:00000000 00000000  0 0 333 1\n"
    )
    v6 = (
        "   0: 00000000000000000000000000000000:1FA4 00000000000000000000000000000000:0000 0A "
        "00000000:00000000 00:00000000 00000000  0 0 444 1\n"
    )
    (net / "tcp").write_text(header + v4)
    (net / "tcp6").write_text(header + v6)
    assert procfs.listening_inodes(8100, tmp_path) == {111, 444}, "listening only, v4 and v6"
    fd = tmp_path / "42" / "fd"
    fd.mkdir(parents=True)
    (fd / "3").symlink_to("socket:[111]")
    (fd / "4").symlink_to("/dev/null")
    assert procfs.socket_inodes([42, 43], tmp_path) == {111}
