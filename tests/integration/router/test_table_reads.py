"""The routing table's full read and the notifications applied while it is under way: what a
notification applied after the read began is newer than what the read found, and is kept.

A deployment created while a full read waited on Redis used to vanish from the table when the
read finished (its snapshot predates it), and a request for it got 404 until the next read.
A route the table does not know is looked for again in Redis, by a read begun after the
request came, before it is refused: a deployment declared a moment before the request, whose
notification has not come yet, is served.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis.asyncio as aioredis

from capycommon.credentials import generate
from capycommon.domain.desired import Demand, DeploymentRecord
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.engineclient import Engines
from capycommon.state import keys
from capycommon.state.desired import DEMAND_FIELD, DeploymentStore
from capycommon.state.stores import State
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher, Limits
from capyctl_router.metrics import Metrics
from capyctl_router.remote import Ingress
from capyctl_router.table import Table
from integration.router.ready import put_deployment, put_ready


class HeldRead(Table):
    """A table whose full read stops where it asks for a joined host's ingress (after it
    read the deployments and instances) until the test lets it go on."""

    def __init__(self, state: State) -> None:
        super().__init__(state, {"local"})
        self.reached = asyncio.Event()
        self.go_on = asyncio.Event()

    async def _read_ingress(self, host: str) -> Ingress | None:
        self.reached.set()
        await self.go_on.wait()
        return await super()._read_ingress(host)


@asynccontextmanager
async def _during_a_full_read(redis_socket: Path, *ready: str) -> AsyncIterator[HeldRead]:
    """A table (a joined host `gpu-b` makes its full read ask for an ingress) whose first
    full read is done and whose second is held part way while the block runs; the
    deployments named in `ready` are ready before both. The second read is let go on and
    awaited when the block ends."""
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as client:
        state = State(client)
        for name in ready:
            await put_ready(client, name)
        await client.sadd(keys.hosts(), "gpu-b")
        table = HeldRead(state)
        table.go_on.set()
        await table.sync()
        table.go_on.clear()
        table.reached.clear()
        read = asyncio.create_task(table.sync())
        await asyncio.wait_for(table.reached.wait(), 5)
        yield table
        table.go_on.set()
        await read


@pytest.mark.anyio
async def test_a_deployment_created_during_a_full_read_is_kept(redis_socket: Path) -> None:
    async with _during_a_full_read(redis_socket) as table:
        await put_ready(table.state.client, "new")
        await table._deployment("new")
        await table._instance("local", "new:0")
        assert table.deployment_of("new") is not None
    assert table.deployment_of("new") is not None, "the read's older snapshot dropped it"
    target = table.target("new")
    assert target is not None
    assert target.secret == "engine-key"


@pytest.mark.anyio
async def test_a_deployment_removed_during_a_full_read_stays_removed(redis_socket: Path) -> None:
    async with _during_a_full_read(redis_socket, "old") as table:
        await table.state.deployments.forget("old")
        await table._deployment("old")
    assert table.deployment_of("old") is None
    assert "old" not in table.instances


@pytest.mark.anyio
async def test_an_instance_that_changed_during_a_full_read_keeps_its_newer_state(
    redis_socket: Path,
) -> None:
    async with _during_a_full_read(redis_socket, "m") as table:
        client = table.state.client
        raw = await client.get(keys.instance("local", "m", 0))
        assert raw is not None
        parked = InstanceRecord.model_validate_json(raw).model_copy(
            update={"state": InstanceState.PARKED}
        )
        await client.set(keys.instance("local", "m", 0), parked.model_dump_json())
        await table._instance("local", "m:0")
    assert table.instances["m"].state == InstanceState.PARKED
    assert table.target("m") is None


@pytest.mark.anyio
async def test_a_notification_read_before_the_full_read_began_does_not_outrank_it(
    redis_socket: Path,
) -> None:
    """Only notifications whose reads began after the full read did are kept over it."""
    async with _during_a_full_read(redis_socket, "m") as table:
        table.records.pop("m")  # as a stale notification would have left it
    assert table.deployment_of("m") is not None


@pytest.mark.anyio
async def test_a_route_declared_before_its_notification_is_found(redis_socket: Path) -> None:
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as client:
        state = State(client)
        table = Table(state, {"local"})
        await table.sync()
        await put_deployment(client, "late")  # its notification not applied yet
        assert table.deployment_of("late") is None
        found = await table.find("late", time.monotonic())
        assert found is not None
        assert found.name == "late"
        assert table.deployment_of("late") is not None, "kept, as its notification would"
        assert await table.find("never", time.monotonic()) is None


class HeldReads:
    """The full reads of a deployment store, each held, once done, until `go_on` is set."""

    def __init__(self, store: DeploymentStore) -> None:
        self.read = asyncio.Event()
        self.go_on = asyncio.Event()
        self._all = store.all

    async def all(self) -> dict[str, DeploymentRecord]:
        found = await self._all()
        self.read.set()
        await self.go_on.wait()
        return found


@pytest.mark.anyio
async def test_a_miss_is_answered_by_a_read_begun_after_it(
    redis_socket: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that missed while a read begun before it was under way waits for the next
    read: the earlier one may predate the deployment it asks for."""
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as client:
        state = State(client)
        held = HeldReads(state.deployments)
        monkeypatch.setattr(state.deployments, "all", held.all)
        table = Table(state, {"local"})
        first = asyncio.create_task(table.find("late", time.monotonic()))
        await asyncio.wait_for(held.read.wait(), 5)  # it has read: `late` is not there
        await put_deployment(client, "late")
        second = asyncio.create_task(table.find("late", time.monotonic()))
        held.go_on.set()
        assert await first is None, "its read began before `late` was declared"
        found = await second
        assert found is not None, "a read begun after the request found it"


@pytest.mark.anyio
async def test_a_request_for_a_deployment_not_yet_notified_is_not_refused(
    redis_socket: Path,
) -> None:
    """Through the router: the model is demanded (it has no instance yet), not a 404."""
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as client:
        state = State(client)
        table = Table(state, {"local"})
        await table.sync()
        await put_deployment(client, "late")
        dispatcher = Dispatcher(state, table, Metrics(), Limits(request_deadline_s=0.5))
        credentials = generate()
        app = create_app(credentials, Router(dispatcher, Engines()))
        body = {"model": "late", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {credentials.api_key}"}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            answer = await http.post("/v1/chat/completions", json=body, headers=headers)
        assert answer.status_code == 503, answer.text
        assert "did not become ready" in answer.json()["error"]["message"]
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await client.xrange(keys.demands()))
        demanded = [Demand.model_validate_json(f[DEMAND_FIELD.encode()]) for _, f in entries]
        assert [d.deployment for d in demanded] == ["late"]
