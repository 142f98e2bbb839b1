"""Clients of replicated servers' Redis on real Redis and Sentinels (`sentinels`), the primary
left alone: a service's client finds the primary through the Sentinels and keeps the blocking
pool's bound; the pipe speaks mutual TLS, and a replica's READONLY answer fails its
connection as lost, so the next command connects again; the CLI reads a replicated server's
primary through the Sentinels its scheduler published."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from capycommon.paths import StatePaths
from capycommon.redistarget import PRIMARY_URL
from capycommon.service import REDIS_ERRORS, redis_client
from capycommon.state import keys
from capycommon.state.pipe import Address, Pipe, Script, Tls
from capycommon.state.primary import SENTINEL_TIMEOUT_S, SentinelPool
from capycommon.state.stores import State
from capyctl_cli import record
from ports import free_port
from sentinels import HOSTS, Servers, replicated_servers
from support import short_dir, wait_for, wait_for_async

COUNTER = Script.of("return redis.call('INCRBY', KEYS[1], ARGV[1])")


@pytest.fixture(scope="module")
def servers() -> Iterator[Servers]:
    with replicated_servers() as found:
        yield found


@pytest.fixture
async def client(servers: Servers) -> AsyncIterator[aioredis.Redis]:
    found = redis_client(servers.control_target(), connections=2)
    try:
        yield found
    finally:
        await found.aclose()


@pytest.mark.anyio
async def test_the_client_finds_the_primary_and_keeps_its_bound(
    servers: Servers, client: aioredis.Redis
) -> None:
    pool = client.connection_pool
    assert isinstance(pool, SentinelPool)
    await client.set("capyctl:bound", "1")
    assert (await client.info("replication"))["role"] == "master"
    assert pool.master_address == (servers.primary(), servers.redis_port)
    # Three blocking reads on two connections: the third waits for one, as on one server.

    async def read() -> Any:
        return await client.blpop(["capyctl:list"], timeout=10)

    reads = [asyncio.create_task(read()) for _ in range(3)]

    async def two_in_use() -> bool:
        return len(pool._in_use_connections) == 2  # the bound under test

    await wait_for_async(two_in_use, 5, "two connections taken")
    assert not any(read.done() for read in reads)
    with servers.direct(HOSTS[0]) as pusher:
        pusher.rpush("capyctl:list", "a", "b", "c")
    popped = await asyncio.wait_for(asyncio.gather(*reads), 10)
    assert sorted(value for _, value in popped) == [b"a", b"b", b"c"]


@pytest.mark.anyio
async def test_the_pipe_runs_scripts_on_the_primary_over_tls(client: aioredis.Redis) -> None:
    pipe = Pipe.of(client)
    assert pipe.locate is not None
    assert pipe.address.tls is not None
    first = await pipe.run(COUNTER, ["capyctl:pipe-counter"], [1])
    assert await pipe.run(COUNTER, ["capyctl:pipe-counter"], [2]) == first + 2


@pytest.mark.anyio
async def test_a_replica_answering_readonly_fails_the_pipe_connection(servers: Servers) -> None:
    replica = next(host for host in HOSTS if host != servers.primary())
    tls = Tls(str(servers.certificate), str(servers.key), str(servers.authority))
    address = Address(
        host=replica,
        port=servers.redis_port,
        username="capyctl",
        password=servers.control_password,
        tls=tls,
    )
    pipe = Pipe(address)
    try:
        with pytest.raises(RedisConnectionError, match="is a replica now"):
            await pipe.run(COUNTER, ["capyctl:readonly"], [1])
        # The connection it failed is gone; the next command opens another.
        assert await pipe.execute(b"PING") == b"PONG"
        with pytest.raises(RedisConnectionError, match="is a replica now"):
            await pipe.execute(b"SET", b"capyctl:readonly", b"1")
    finally:
        pipe.close()


@pytest.mark.anyio
async def test_no_sentinel_answering_is_an_outage_said_at_once(servers: Servers) -> None:
    """Sentinels that are all down: every command fails as Redis away (a ConnectionError, in
    REDIS_ERRORS), within the Sentinels' own timeouts, naming why each failed."""
    nowhere = servers.topology().model_copy(
        update={"sentinels": tuple(f"{host}:{free_port(host)}" for host in HOSTS)}
    )
    target = replace(servers.control_target(), topology=nowhere)
    client = redis_client(target)
    try:
        started = time.monotonic()
        with pytest.raises(REDIS_ERRORS) as failed:
            await client.ping()
        assert time.monotonic() - started < 2 * SENTINEL_TIMEOUT_S
        assert isinstance(failed.value, RedisConnectionError)
        assert "no Sentinel names a primary for 'capyctl'" in str(failed.value)
        for address in nowhere.sentinels:
            assert f"Sentinel {address}: Error 111 connecting" in str(failed.value)
    finally:
        await client.aclose()


def test_the_cli_reads_a_replicated_servers_primary(servers: Servers) -> None:
    """A replicated server's record names only the scheme: the CLI finds the Sentinels in
    the server's own Redis (here a replica's), then talks to the primary through them."""
    state_dir = short_dir("cli-primary")
    try:
        paths = StatePaths(state_dir)
        replica = next(host for host in HOSTS if host != servers.primary())
        _server_state(servers, paths, replica)
        with record.blocking_to(servers.control_target(), timeout=5) as primary:
            primary(lambda found: found.topology.publish(servers.topology()))
        with servers.direct(replica) as local:
            wait_for(lambda: local.exists(keys.topology()), 10, "the topology on the replica")
        target = record.target_of(_server_record(state_dir))
        assert target.topology == servers.topology()
        assert target.tls is not None
        assert target.tls.key == paths.server_key
        written = secrets.token_hex(8)

        async def write(found: State) -> None:
            await found.client.set("capyctl:cli-write", written)

        with record.state_of(_server_record(state_dir)) as state:
            state(write)  # only the primary takes a write
        with servers.direct(servers.primary() or "") as primary_client:
            assert primary_client.get("capyctl:cli-write") == written.encode()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def _server_record(state_dir: Path) -> record.RoleRecord:
    return record.RoleRecord(
        role="server",
        version="0",
        pid=1,
        supervisord_pid=1,
        started_at=0.0,
        state_dir=str(state_dir),
        document=None,
        processes=[],
        redis_url=PRIMARY_URL,
        host=None,
        listeners={},
    )


def _server_state(servers: Servers, paths: StatePaths, local: str) -> None:
    """The files a server's processes reach the primary with, in a server's state dir whose
    own Redis is `local`'s."""
    paths.identity_dir.mkdir(mode=0o700)
    paths.authority_dir.mkdir(mode=0o700)
    (paths.authority_dir / servers.authority.name).write_bytes(servers.authority.read_bytes())
    paths.server_certificate.write_bytes(servers.certificate.read_bytes())
    paths.server_key.write_bytes(servers.key.read_bytes())
    paths.server_key.chmod(0o600)
    paths.redis_password.write_text(servers.control_password + "\n")
    paths.redis_password.chmod(0o600)
    paths.redis_dir.mkdir(mode=0o700)
    paths.redis_socket.symlink_to(servers.socket(local))
