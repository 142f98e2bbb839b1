"""A service's client closes its TLS connections to Redis at once, without waiting for the
server's goodbye: a frozen former primary never says it, and each connection left to it
would keep its socket for asyncio's 30 s, or past the loop's end (`state/aborting.py`)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from datetime import timedelta

import pytest

from capycommon.authority import CERT_FILE, Authority
from capycommon.redistarget import RedisTarget, TlsFiles
from capycommon.service import redis_client
from ports import free_port
from support import redis_server, short_dir


@pytest.mark.anyio
async def test_a_connection_to_a_frozen_redis_closes_at_once() -> None:
    folder = short_dir("tls-close")
    authority = Authority.create(folder / "ca", "test authority")
    certificate, key = authority.issue_server(["127.0.0.1"], timedelta(days=1), client=True)
    (folder / "server.pem").write_bytes(certificate)
    (folder / "server.key").write_bytes(key)
    (folder / "server.key").chmod(0o600)
    port = free_port()
    tls = ["--tls-port", str(port), "--bind", "127.0.0.1"]
    tls += [
        "--tls-cert-file",
        str(folder / "server.pem"),
        "--tls-key-file",
        str(folder / "server.key"),
    ]
    tls += ["--tls-ca-cert-file", str(folder / "ca" / CERT_FILE)]
    proc = redis_server(folder, *tls)
    files = TlsFiles(folder / "server.pem", (folder / "ca" / CERT_FILE), key=folder / "server.key")
    client = redis_client(RedisTarget(f"rediss://127.0.0.1:{port}", tls=files))
    try:
        assert await client.ping() is True
        (connection,) = client.connection_pool._available_connections
        assert connection._writer is not None
        raw = connection._writer.transport.get_extra_info("socket")
        os.kill(proc.pid, signal.SIGSTOP)  # frozen: it never answers the goodbye
        async with asyncio.timeout(1):
            await client.aclose()
        await asyncio.sleep(0)  # the loop's next turn closes an aborted socket
        assert raw.fileno() == -1, "the socket is closed, not left to the goodbye"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
