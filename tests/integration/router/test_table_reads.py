"""The routing table's full read and the notifications applied while it is under way: what a
notification applied after the read began is newer than what the read found, and is kept.

A deployment created while a full read waited on Redis used to vanish from the table when the
read finished (its snapshot predates it), and a request for it got 404 until the next read.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from capycommon.state import keys
from capycommon.state.desired import DeploymentStore
from capycommon.state.instances import InstanceRecord, InstanceState
from capyctl_router.remote import Ingress
from capyctl_router.table import Table
from integration.router.ready import put_ready


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class HeldRead(Table):
    """A table whose full read stops where it asks for a joined host's ingress (after it
    read the deployments and instances) until the test lets it go on."""

    def __init__(self, client: aioredis.Redis) -> None:
        super().__init__(client, {"local"})
        self.reached = asyncio.Event()
        self.go_on = asyncio.Event()

    async def _read_ingress(self, host: str) -> Ingress | None:
        self.reached.set()
        await self.go_on.wait()
        return await super()._read_ingress(host)


async def _held(client: aioredis.Redis) -> tuple[HeldRead, asyncio.Task[None]]:
    """A table (a joined host `gpu-b` makes its full read ask for an ingress), its first full
    read done, and a second one held part way."""
    await client.sadd(keys.hosts(), "gpu-b")
    table = HeldRead(client)
    table.go_on.set()
    await table.sync()
    table.go_on.clear()
    table.reached.clear()
    read = asyncio.create_task(table.sync())
    await asyncio.wait_for(table.reached.wait(), 5)
    return table, read


@pytest.mark.anyio
async def test_a_deployment_created_during_a_full_read_is_kept(redis_socket: Path) -> None:
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as client:
        table, read = await _held(client)
        await put_ready(client, "new")
        await table._deployment("new")
        await table._instance("local", "new:0")
        assert table.deployment_of("new") is not None
        table.go_on.set()
        await read
        assert table.deployment_of("new") is not None, "the read's older snapshot dropped it"
        target = table.target("new")
        assert target is not None
        assert target.secret == "engine-key"


@pytest.mark.anyio
async def test_a_deployment_removed_during_a_full_read_stays_removed(redis_socket: Path) -> None:
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as client:
        await put_ready(client, "old")
        table, read = await _held(client)
        await DeploymentStore(client).forget("old")
        await table._deployment("old")
        table.go_on.set()
        await read
        assert table.deployment_of("old") is None
        assert "old" not in table.instances


@pytest.mark.anyio
async def test_an_instance_that_changed_during_a_full_read_keeps_its_newer_state(
    redis_socket: Path,
) -> None:
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as client:
        await put_ready(client, "m")
        table, read = await _held(client)
        raw = await client.get(keys.instance("local", "m", 0))
        assert raw is not None
        parked = InstanceRecord.model_validate_json(raw).model_copy(
            update={"state": InstanceState.PARKED}
        )
        await client.set(keys.instance("local", "m", 0), parked.model_dump_json())
        await table._instance("local", "m:0")
        table.go_on.set()
        await read
        assert table.instances["m"].state == InstanceState.PARKED
        assert table.target("m") is None


@pytest.mark.anyio
async def test_a_notification_read_before_the_full_read_began_does_not_outrank_it(
    redis_socket: Path,
) -> None:
    """Only notifications whose reads began after the full read did are kept over it."""
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as client:
        await put_ready(client, "m")
        table, read = await _held(client)
        table.records.pop("m")  # as a stale notification would have left it
        table.go_on.set()
        await read
        assert table.deployment_of("m") is not None
