"""A service process against a real redis-server: heartbeat, loss of Redis, shutdown."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from support import clean_env, service_command, short_dir, wait_for

HEARTBEAT = "capyctl:host:local:heartbeat:hostd"


@pytest.fixture
def state() -> Iterator[Path]:
    folder = short_dir("svc")
    (folder / "config").mkdir()
    (folder / "config" / "standalone.yaml").write_text(
        "kind: standalone\nredis:\n  unreachable_after: 1.5\n"
    )
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _hostd(state: Path, redis_url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        service_command("hostd", state),
        env=clean_env(CAPYCTL_REDIS_URL=redis_url, CAPYCTL_HOST_NAME="local"),
        stderr=subprocess.PIPE,
        text=True,
    )


def _lines(stderr: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def test_heartbeat_while_running_and_cleared_on_sigterm(state: Path, redis_socket: Path) -> None:
    client = redis.Redis(unix_socket_path=str(redis_socket))
    proc = _hostd(state, f"unix://{redis_socket}")
    try:
        raw = wait_for(lambda: client.get(HEARTBEAT), timeout=10, what="hostd's heartbeat")
        beat = json.loads(cast(bytes, raw))
        assert beat["service"] == "hostd"
        assert beat["pid"] == proc.pid
        assert beat["version"] == "0.1.0"
        assert beat["last_seen"] >= beat["started_at"]
        assert 0 < client.ttl(HEARTBEAT) <= 10
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
        assert proc.returncode == 0
        assert client.get(HEARTBEAT) is None
        messages = [line["message"] for line in _lines(stderr)]
        assert messages == ["started", "published engines", "stopped"]
    finally:
        proc.kill()
        client.close()


def test_exits_non_zero_naming_redis_when_it_cannot_be_reached(state: Path) -> None:
    gone = state / "nothing.sock"
    proc = _hostd(state, f"unix://{gone}")
    _, stderr = proc.communicate(timeout=15)
    assert proc.returncode == 22
    (line,) = _lines(stderr)
    assert line["level"] == "error"
    assert line["service"] == "hostd"
    assert str(line["message"]).startswith(
        f"error [redis_unreachable]: cannot reach Redis at unix://{gone} after 1.5 s"
    )


def test_reconnects_when_redis_comes_back_and_exits_when_it_does_not(state: Path) -> None:
    folder = short_dir("redis")
    sock = folder / "r.sock"
    argv = [
        "redis-server",
        "--port",
        "0",
        "--unixsocket",
        str(sock),
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(folder),
    ]
    server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    proc: subprocess.Popen[str] | None = None
    try:
        wait_for(sock.exists, timeout=10, what="redis socket")
        client = redis.Redis(unix_socket_path=str(sock))
        proc = _hostd(state, f"unix://{sock}")
        wait_for(lambda: client.get(HEARTBEAT), timeout=10, what="first heartbeat")
        server.kill()
        server.wait()
        server = subprocess.Popen(argv, stdout=subprocess.DEVNULL)

        def beating_again() -> bool:
            if proc is not None and proc.poll() is not None:
                raise AssertionError(
                    f"hostd exited during a short outage:\n{proc.communicate()[1]}"
                )
            return bool(client.get(HEARTBEAT))

        wait_for(beating_again, timeout=10, what="heartbeat after a restart")
        server.kill()
        server.wait()
        _, stderr = proc.communicate(timeout=15)
        assert proc.returncode == 22
        messages = [str(line["message"]) for line in _lines(stderr)]
        assert "lost Redis; reconnecting" in messages
        assert messages[-1].startswith("error [redis_unreachable]: Redis unreachable for 1.5 s")
        client.close()
    finally:
        server.kill()
        server.wait()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(folder, ignore_errors=True)
