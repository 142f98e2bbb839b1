from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from support import short_dir, wait_for


@pytest.fixture
def redis_socket() -> Iterator[Path]:
    """A real redis-server on a private unix socket, stopped after the test."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed; run scripts/setup")
    folder = short_dir("redis")
    sock = folder / "redis.sock"
    proc = subprocess.Popen(
        [
            server,
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--dir",
            str(folder),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(sock.exists, timeout=10, what="redis-server's socket")
        yield sock
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
