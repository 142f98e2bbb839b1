"""What a host writes under its own prefix is weighed, never believed: against a real Redis,
with the values a hostile host wrote there, the stores refuse what is malformed, oversized or
lying about its host or its name; the router's table and the scheduler's snapshot keep the
deployment on the host the scheduler placed it on; every refusal is counted once, and the
router's /metrics shows the count by host and kind."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.state import keys
from capycommon.state.quarantine import MAX_VALUE_BYTES, REFUSALS
from capycommon.state.stores import State
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table
from capyctl_scheduler.observe import Observer
from integration.router.ready import put_ready

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client(redis_socket: Path) -> AsyncIterator[aioredis.Redis]:
    async with aioredis.Redis(unix_socket_path=str(redis_socket)) as found:
        yield found


@pytest.fixture
def state(client: aioredis.Redis) -> State:
    return State(client)


async def placed_on_hb(state: State) -> None:
    """Deployment s1, generation 1 placed on host hb, ready there; ha and hb joined."""
    await state.client.sadd(keys.hosts(), "ha", "hb")
    await put_ready(state.client, "s1", host="hb")
    record = await state.deployments.get("s1")
    assert record is not None
    await state.deployments.put(record.model_copy(update={"host": "hb"}))


async def forge(client: aioredis.Redis, member: str, value: bytes | str) -> None:
    """As host ha: write `value` as the record of `member`, and list it."""
    deployment, _, index = member.rpartition(":")
    await client.set(keys.instance("ha", deployment, int(index)), value)
    await client.sadd(keys.instances("ha"), member)


def hijack(generation: int) -> str:
    """hb's record of s1, as ha would forge it to take s1 over."""
    return InstanceRecord(
        deployment="s1",
        instance=0,
        revision=1,
        generation=generation,
        state=InstanceState.READY,
        since=time.time(),
        host="ha",
        port=8100,
    ).model_dump_json()


async def test_the_store_refuses_what_cannot_be_believed(
    client: aioredis.Redis, state: State
) -> None:
    await placed_on_hb(state)
    real = await state.instances("hb").get("s1", 0)
    assert real is not None
    await forge(client, "bogus:0", "{not json")
    await forge(client, "named:0", real.model_dump_json())  # hb's record, of s1, under ha
    await forge(client, "s1:0", real.model_copy(update={"host": "hb"}).model_dump_json())
    await forge(client, "huge:0", b"x" * (MAX_VALUE_BYTES + 1))
    await forge(
        client,
        "good:0",
        real.model_copy(update={"deployment": "good", "host": "ha"}).model_dump_json(),
    )
    store = state.instances("ha")
    found = await store.all()
    assert [r.member for r in found] == ["good:0"]
    assert await store.get("bogus", 0) is None


async def test_a_forged_higher_generation_moves_nothing(
    client: aioredis.Redis, state: State
) -> None:
    await placed_on_hb(state)
    await forge(client, "s1:0", hijack(50))
    table = Table(state, set())
    await table.sync()
    await table._instance("ha", "s1:0")  # as ha's notification would make it read
    assert table.instances["s1"].host == "hb"
    snapshot = await Observer(state, []).snapshot()
    assert snapshot.instances["s1"].host == "hb"
    assert [(o.host, o.generation) for o in snapshot.orphans] == [("ha", 50)]


async def test_the_same_generation_on_a_host_it_was_not_placed_on_moves_nothing(
    client: aioredis.Redis, state: State
) -> None:
    await placed_on_hb(state)
    await forge(client, "s1:0", hijack(1))
    await client.delete(keys.instance("hb", "s1", 0))  # even with hb's own record gone
    table = Table(state, set())
    await table.sync()
    assert "s1" not in table.instances
    await table._instance("ha", "s1:0")
    assert "s1" not in table.instances
    assert "s1" not in (await Observer(state, []).snapshot()).instances


@pytest.mark.parametrize(
    "kind",
    ["memory", "info", "engines", "models", "engine-load", "heartbeat:hostd", "instance"],
)
async def test_a_malformed_value_of_each_kind_costs_its_key_alone(
    client: aioredis.Redis, state: State, kind: str
) -> None:
    await placed_on_hb(state)
    bad = "{not json"
    if kind == "engine-load":
        await client.hset(keys.engine_load("ha"), "s1:0", bad)
    elif kind == "instance":
        await forge(client, "bogus:0", bad)
    else:
        await client.set(f"{keys.host_prefix('ha')}:{kind}", bad)
    snapshot = await Observer(state, []).snapshot()
    assert snapshot.instances["s1"].host == "hb"
    assert set(snapshot.hosts) == {"ha", "hb"}
    table = Table(state, set())
    await table.sync()
    assert table.instances["s1"].host == "hb"


async def test_refusals_are_counted_once_and_shown_by_host_and_kind(
    client: aioredis.Redis, state: State
) -> None:
    REFUSALS.drain()  # what earlier tests of this process refused is theirs
    await placed_on_hb(state)
    await forge(client, "s1:0", hijack(7))
    await forge(client, "other:0", "[]")
    for _ in range(3):  # read again and again, as the services do
        await Observer(state, []).snapshot()
        await state.refusals.send()
    counts = await state.refusals.counts()
    assert counts[("ha", "instance")] == 2
    text = (await Metrics().scrape(state)).decode()
    assert 'capyctl_host_records_refused_total{host="ha",kind="instance"} 2.0' in text
