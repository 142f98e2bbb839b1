"""A joined host's hostd, a real process, among replicated servers (`sentinels`): started with
a joined file that has no topology yet (the host joined before its servers replicated), it
reaches the server it joined, writes the topology the servers published into the file, and
from its next start reaches the primary through the Sentinels, beating there, and on the
new primary once the first one is lost."""

from __future__ import annotations

import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from capycommon import joined
from capycommon.paths import StatePaths, ensure_private_dir, write_atomic
from capycommon.state import acl, functions, keys
from ports import engine_ports, free_port
from sentinels import HOSTS, Servers, replicated_servers
from support import clean_env, short_dir, wait_for

HOST = "gpu1"


@pytest.fixture
def servers() -> Iterator[Servers]:
    with replicated_servers() as found:
        with found.direct(HOSTS[0]) as control:
            control.function_load(functions.SOURCE, replace=True)
            control.set(keys.topology(), found.topology().model_dump_json())
        yield found


@pytest.fixture
def state(servers: Servers) -> Iterator[StatePaths]:
    """A host that joined the first server, before its servers replicated."""
    folder = short_dir("joined")
    paths = StatePaths(folder / "state")
    password = secrets.token_urlsafe(32)
    servers.make_host_user(HOST, password)
    ensure_private_dir(paths.identity_dir)
    certificate = servers.host_certificate(HOST)
    write_atomic(paths.host_certificate, certificate.read_text(), mode=0o600)
    write_atomic(paths.joined_authority, servers.authority.read_text())
    found = joined.Joined(
        host_name=HOST,
        host_id="a" * 32,
        server_version="0.1.0",
        bootstrap_address=f"{HOSTS[0]}:7444",
        redis_address=f"{HOSTS[0]}:{servers.redis_port}",
        redis_user=acl.host_user(HOST),
        redis_password=password,
        joined_at=time.time(),
    )
    joined.write(paths, found)
    (folder / "models").mkdir()
    try:
        yield paths
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _hostd(paths: StatePaths) -> subprocess.Popen[bytes]:
    env = clean_env(
        CAPYCTL_HOST_NAME=HOST,
        CAPYCTL_MODELS_ROOT=str(paths.root.parent / "models"),
        CAPYCTL_ENGINE_PORTS=engine_ports(),
        CAPYCTL_HOST_INGRESS_BIND=f"127.0.0.1:{free_port()}",
        CAPYCTL_SIMULATED_GPUS="gpu0:24GiB",
    )
    log = (paths.root.parent / "hostd.log").open("ab")
    with log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "capyctl_hostd",
                "--role",
                "host",
                "--state-dir",
                str(paths.root),
            ],
            env=env,
            stdout=log,
            stderr=log,
        )


def _beats_on(servers: Servers, host: str) -> bool:
    try:
        with servers.direct(host) as found:
            return bool(found.exists(keys.heartbeat("hostd", HOST)))
    except redis.ConnectionError:
        return False


def _new_primary(servers: Servers) -> str | None:
    found = servers.primary()
    return None if found == HOSTS[0] else found


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=15)


def test_hostd_learns_the_sentinels_and_follows_the_primary(
    servers: Servers, state: StatePaths
) -> None:
    proc = _hostd(state)
    try:
        wait_for(lambda: _beats_on(servers, HOSTS[0]), 30, "hostd's heartbeat")

        def learned() -> bool:
            found = joined.read(state)
            return found is not None and found.topology == servers.topology()

        wait_for(learned, 10, "the topology in the joined file")
        assert _stop(proc) == 0
        with servers.direct(HOSTS[0]) as first:
            first.delete(keys.heartbeat("hostd", HOST))
        proc = _hostd(state)  # its next start: through the Sentinels
        wait_for(lambda: _beats_on(servers, HOSTS[0]), 30, "hostd's heartbeat again")
        said = (state.root.parent / "hostd.log").read_text()
        assert f"the primary of Sentinels {','.join(servers.topology().sentinels)}" in said
        servers.kill(HOSTS[0])
        primary = wait_for(lambda: _new_primary(servers), 20, "a new primary")
        with servers.direct(primary) as found:
            found.delete(keys.heartbeat("hostd", HOST))  # the one replicated before the loss
        wait_for(lambda: _beats_on(servers, primary), 20, "hostd's heartbeat on the new primary")
        assert proc.poll() is None
        assert _stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
