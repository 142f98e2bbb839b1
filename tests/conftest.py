from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from capycommon.state import functions
from support import redis_server, short_dir


@pytest.fixture
def redis_socket() -> Iterator[Path]:
    """A real redis-server on a private unix socket, stopped after the test, with CapyCTL's
    functions loaded, as the control plane (the scheduler) loads them in a role."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed; run scripts/setup")
    folder = short_dir("redis")
    proc = redis_server(folder, "--appendonly", "no")
    try:
        with redis.Redis(unix_socket_path=str(folder / "redis.sock")) as client:
            client.function_load(functions.SOURCE, replace=True)
        yield folder / "redis.sock"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def anyio_backend() -> str:
    """Every async test runs on asyncio, the services' loop (trio, which selenium brings
    into the environment, would otherwise be tried too)."""
    return "asyncio"
