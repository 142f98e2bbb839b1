"""A server's Redis keeps its transactions across a restart: with the server's ACL file, what
the control plane wrote in MULTI/EXEC is there again once Redis replayed its append-only file
(Redis 7.0 replays it as the default user and checks each transaction against that user's
rights at EXEC, so an ACL file that turned the default user off lost every one)."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

import redis

from capycommon.state import acl
from support import redis_server, short_dir

PASSWORD = "control-plane-password"


def _redis(folder: Path) -> subprocess.Popen[bytes]:
    aof = ("--appendonly", "yes", "--appendfsync", "always")
    return redis_server(folder, *aof, "--aclfile", str(folder / "users.acl"))


def _control(folder: Path) -> redis.Redis:
    sock = folder / "redis.sock"
    return redis.Redis(unix_socket_path=str(sock), username=acl.CONTROL_USER, password=PASSWORD)


def _raw(sock: Path, command: bytes) -> bytes:
    """One inline command on a connection that never logged in, and Redis's reply."""
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(sock))
        raw.sendall(command + b"\r\n")
        return raw.recv(4096)


def _stopped(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def test_transactions_written_before_a_restart_are_there_after_it() -> None:
    folder = short_dir("acl-aof")
    (folder / "users.acl").write_text(acl.acl_file(PASSWORD, []))
    proc = _redis(folder)
    try:
        with _control(folder).pipeline(transaction=True) as pipe:
            pipe.set("capyctl:deployment:m", "{}")
            pipe.sadd("capyctl:deployments", "m")
            pipe.execute()
        _stopped(proc)
        (folder / "users.acl").write_text(acl.acl_file(PASSWORD, []))  # as each start writes it
        proc = _redis(folder)
        control = _control(folder)
        assert control.smembers("capyctl:deployments") == {b"m"}
        assert control.get("capyctl:deployment:m") == b"{}"
    finally:
        _stopped(proc)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_client_that_does_not_log_in_can_do_nothing() -> None:
    folder = short_dir("acl-aof")
    (folder / "users.acl").write_text(acl.acl_file(PASSWORD, []))
    proc = _redis(folder)
    try:
        for command in (b"PING", b"GET capyctl:deployments", b"SET k v", b'AUTH ""'):
            reply = _raw(folder / "redis.sock", command)
            assert reply.startswith((b"-NOAUTH", b"-WRONGPASS")), (command, reply)
    finally:
        _stopped(proc)
        shutil.rmtree(folder, ignore_errors=True)
