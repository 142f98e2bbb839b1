"""A primary and its replica, two real redis-servers: the hosts' users reach the replica's
own Redis through the record replication carries (a forged record is refused), and a
declaration is acknowledged only once the replica holds it."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from capycommon.state import acl, keys, quarantine
from capycommon.state.replicas import ReplicaStore
from capyctl_scheduler.replicated import ConfirmedWrites, UserMirror
from ports import reserved_port
from support import redis_server, short_dir, wait_for


@dataclass
class Pair:
    primary_port: int
    replica_port: int
    folder: Path
    replica: subprocess.Popen[bytes]

    def client(self, port: int) -> aioredis.Redis:
        return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=5)

    def stop_replica(self) -> None:
        self.replica.kill()
        self.replica.wait()


@pytest.fixture
def pair() -> Iterator[Pair]:
    folder = short_dir("replicated")
    holders = [reserved_port(), reserved_port()]
    ports = [holder.getsockname()[1] for holder in holders]
    for name in ("p", "r"):  # each with an ACL file, as a server's Redis
        (folder / name).mkdir()
        (folder / name / "users.acl").touch()
    primary = redis_server(
        folder / "p", "--port", str(ports[0]), "--bind", "127.0.0.1",
        "--aclfile", str(folder / "p" / "users.acl"),
    )  # fmt: skip
    replica = redis_server(
        folder / "r", "--port", str(ports[1]), "--bind", "127.0.0.1",
        "--aclfile", str(folder / "r" / "users.acl"), "--replicaof", "127.0.0.1", str(ports[0]),
    )  # fmt: skip
    found = Pair(ports[0], ports[1], folder, replica)
    try:
        with redis.Redis(host="127.0.0.1", port=ports[1]) as client:
            wait_for(
                lambda: client.info("replication").get("master_link_status") == "up",
                timeout=20,
                what="the replica to follow its primary",
            )
        yield found
    finally:
        for proc in (primary, replica):
            proc.kill()
            proc.wait()
        for holder in holders:
            holder.close()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def clients(pair: Pair) -> AsyncIterator[tuple[aioredis.Redis, aioredis.Redis]]:
    primary, replica = pair.client(pair.primary_port), pair.client(pair.replica_port)
    try:
        yield primary, replica
    finally:
        await primary.aclose()
        await replica.aclose()


async def command(client: aioredis.Redis, *args: str) -> Any:
    send: Callable[..., Awaitable[Any]] = client.execute_command
    return await send(*args)


@pytest.mark.anyio
async def test_hosts_users_follow_the_primary_on_the_replicas_own_redis(
    pair: Pair, clients: tuple[aioredis.Redis, aioredis.Redis]
) -> None:
    primary, replica = clients
    users = acl.HostUserStore(primary)
    await users.set("a", "secret-of-a")
    # A host that joined before the record was kept: a user the record lacks.
    await command(primary, "ACL", "SETUSER", "host-b", *acl.host_rules("b", "secret-of-b"))
    assert await users.record_held() == 1
    assert await ReplicaStore(primary).confirm(1, 5) == 1
    mirror = UserMirror(replica)
    assert await mirror.once(), "the replica follows"
    assert not await UserMirror(primary).once(), "the primary has nothing to follow"
    for host in ("a", "b"):
        async with aioredis.Redis(host="127.0.0.1", port=pair.replica_port) as logged:
            assert await logged.auth(f"secret-of-{host}", f"host-{host}")
            assert await logged.get(keys.server_version()) is None  # a host's read, allowed

    await users.remove("a")
    before = sum(quarantine.REFUSALS.counts.values())
    await primary.hset(keys.host_users(), "c", "not a digest")  # forged: never a user
    assert await ReplicaStore(primary).confirm(1, 5) == 1
    await mirror.once()
    assert set(await acl.HostUserStore(replica).held()) == {"b"}
    assert sum(quarantine.REFUSALS.counts.values()) == before + 1
    async with aioredis.Redis(host="127.0.0.1", port=pair.replica_port) as logged:
        with pytest.raises(AuthenticationError):
            await logged.auth("secret-of-a", "host-a")


def app_writing(primary: aioredis.Redis) -> Starlette:
    async def declare(_: Request) -> JSONResponse:
        await primary.set("capyctl:deployment:x", "declared")
        return JSONResponse({"declared": "x"}, status_code=201)

    return Starlette(routes=[Route("/declare", declare, methods=["POST"])])


@pytest.mark.anyio
async def test_a_declaration_is_acknowledged_once_a_replica_holds_it(
    pair: Pair, clients: tuple[aioredis.Redis, aioredis.Redis]
) -> None:
    primary, replica = clients
    app = ConfirmedWrites(app_writing(primary), ReplicaStore(primary), timeout_s=0.5)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://scheduler") as client:
        answer = await client.post("/declare")
        assert (answer.status_code, answer.json()) == (201, {"declared": "x"})
        assert await replica.get("capyctl:deployment:x") == b"declared", "on the replica first"
        pair.stop_replica()
        refused = await client.post("/declare")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "not_replicated"
    assert "no replica confirmed it within 0.5 s" in refused.json()["error"]["message"]
