"""A joined host keeps the servers' topology in its joined file (`capyctl_hostd.topology`),
against a real Redis: the topology the servers published is written into the file, once; a
changed one replaces it; a value that is not a topology is refused and changes nothing; and
nothing published leaves the file as it is."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from capycommon import joined
from capycommon.domain.replication import Topology
from capycommon.paths import StatePaths
from capycommon.service import redis_client
from capycommon.state import keys, quarantine
from capycommon.state.stores import State
from capyctl_hostd import topology
from support import cancel, short_dir, wait_for_async
from unit.test_replicated_targets import joined_record

TOPOLOGY = Topology(
    service="capyctl",
    sentinels=("10.0.0.11:26379", "10.0.0.12:26379", "10.0.0.13:26379"),
    user="capyctl-discover",
    password="discover-password",
)


@pytest.fixture
def paths() -> Iterator[StatePaths]:
    """A joined host's state dir, its joined file without a topology (a host that joined
    one server)."""
    folder = short_dir("follow")
    found = StatePaths(folder)
    joined.write(found, joined_record())
    try:
        yield found
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def client(redis_socket: Path) -> AsyncIterator[aioredis.Redis]:
    found = redis_client(f"unix://{redis_socket}")
    try:
        yield found
    finally:
        await found.aclose()


def _kept(paths: StatePaths) -> Topology | None:
    found = joined.read(paths)
    assert found is not None
    return found.topology


@pytest.fixture
async def state(client: aioredis.Redis) -> State:
    """The server's Redis with TOPOLOGY published, as a replicated server's scheduler does."""
    found = State(client)
    await found.topology.publish(TOPOLOGY)
    return found


@pytest.mark.anyio
async def test_the_joined_file_gains_the_published_topology(
    state: State, paths: StatePaths
) -> None:
    stop = asyncio.Event()
    following = asyncio.create_task(topology.follow(state, paths, stop))
    try:

        async def written() -> bool:
            return _kept(paths) == TOPOLOGY

        await wait_for_async(written, 10, "the topology in the joined file")
        before = paths.joined.stat().st_mtime_ns
        assert await topology.refresh(state, paths) is None  # the same: not written again
        assert paths.joined.stat().st_mtime_ns == before
        assert paths.joined.stat().st_mode & 0o777 == 0o600
    finally:
        stop.set()
        await cancel(following)
    found = joined.read(paths)
    assert found is not None
    assert found.redis_password == "host-password"  # the rest of the file as it was


@pytest.mark.anyio
async def test_a_changed_topology_replaces_the_kept_one(state: State, paths: StatePaths) -> None:
    assert await topology.refresh(state, paths) == TOPOLOGY
    moved = TOPOLOGY.model_copy(update={"sentinels": ("10.0.0.21:26379", "10.0.0.12:26379")})
    await state.topology.publish(moved)
    assert await topology.refresh(state, paths) == moved
    assert _kept(paths) == moved


@pytest.mark.anyio
async def test_nothing_published_or_a_damaged_value_changes_nothing(
    client: aioredis.Redis, paths: StatePaths
) -> None:
    state = State(client)
    assert await topology.refresh(state, paths) is None
    assert _kept(paths) is None
    refused = sum(quarantine.REFUSALS.counts.values())
    await client.set(keys.topology(), '{"service": "capyctl", "sentinels": []}')
    assert await topology.refresh(state, paths) is None
    assert _kept(paths) is None
    assert sum(quarantine.REFUSALS.counts.values()) == refused + 1
