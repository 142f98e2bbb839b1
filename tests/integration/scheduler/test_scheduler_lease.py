"""The scheduler lease over a real redis-server: one scheduler of several acts, a new holder
takes the next epoch, and a holder frozen past its lease stops acting while another takes
over within the bound; every instance command carries the epoch of the lease it was sent
under."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import cast

import pytest
import redis.asyncio as aioredis

from capycommon.domain.commands import Launch
from capycommon.service import wait_event
from capycommon.state import hostcommands, keys, quarantine
from capycommon.state.leader import LeaderStore
from capycommon.state.stores import State
from capyctl_scheduler.leadership import LEASE_S, RENEW_S, Leadership
from capyctl_scheduler.loop import Scheduler
from capyctl_scheduler.observe import Observer
from integration.scheduler.livehost import live_host
from integration.scheduler.test_commands_once import declared
from support import poll, wait_for, wait_for_async
from unit.readings import GiB, idle_reading

HOST = "local"


@pytest.fixture
async def leader(redis_socket: Path) -> AsyncIterator[LeaderStore]:
    client = aioredis.Redis(unix_socket_path=str(redis_socket))
    try:
        yield LeaderStore(client)
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_one_holder_at_a_time_each_new_one_under_the_next_epoch(
    leader: LeaderStore,
) -> None:
    assert await claimed(leader, "s1", "t1") == (True, "s1", 1)
    assert await claimed(leader, "s2", "t2") == (False, "s1", 1), "s1 holds it"
    assert await claimed(leader, "s1", "t1") == (True, "s1", 1), "a renewal keeps the epoch"
    # s1's scheduler restarted: its new process takes the lease over at once, anew.
    assert await claimed(leader, "s1", "t3") == (True, "s1", 2)
    assert not await leader.release("t1"), "a token that no longer holds gives nothing up"
    assert await leader.release("t3")
    assert await leader.current() is None
    assert await claimed(leader, "s2", "t2") == (True, "s2", 3)
    assert await leader.epoch() == 3


async def claimed(
    leader: LeaderStore, server: str, token: str, ttl_s: float = 30
) -> tuple[bool, str, int] | None:
    """A claim's answer: (whether the caller holds the lease, its holder, its epoch)."""
    ours, lease = await leader.claim(server, token, ttl_s)
    return None if lease is None else (ours, lease.server, lease.epoch)


@pytest.mark.anyio
async def test_a_lease_not_renewed_passes_to_another_on_redis_clock(
    leader: LeaderStore,
) -> None:
    await leader.claim("s1", "t1", 0.3)

    async def taken() -> bool:
        ours, _ = await leader.claim("s2", "t2", 30)
        return ours

    await wait_for_async(taken, timeout=5, what="s2 to take the lapsed lease", interval=0.05)
    assert await claimed(leader, "s1", "t1") == (False, "s2", 2)


@pytest.mark.anyio
async def test_a_lease_that_is_not_one_is_refused_and_taken_over(leader: LeaderStore) -> None:
    await leader.client.set(keys.scheduler_lease(), b"\xff not a lease")
    before = refused()
    assert await leader.current() is None
    assert refused() == before + 1, "refused and counted"
    assert await claimed(leader, "s1", "t1") == (True, "s1", 1)
    await leader.client.set(keys.scheduler_epoch(), "many")
    assert await leader.epoch() is None
    assert refused() == before + 2


def refused() -> int:
    return sum(quarantine.REFUSALS.counts.values())


class Frozen:
    """A scheduler on an event loop of its own thread, as a server's scheduler process is:
    `freeze` blocks its loop (as SIGSTOP stops the process), `thaw` lets it go on."""

    def __init__(self, redis_socket: Path, server: str) -> None:
        self.redis_socket = redis_socket
        self.server = server
        self.loop = asyncio.new_event_loop()
        self.thawed = threading.Event()
        self.thawed.set()
        self.scheduler: Scheduler | None = None
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self.loop.run_until_complete(self._serve())
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()

    async def _serve(self) -> None:
        state = State(aioredis.Redis(unix_socket_path=str(self.redis_socket)))
        self.stop = asyncio.Event()
        leadership = Leadership(state.leader, self.server)
        self.scheduler = Scheduler(state, Observer(state, [HOST]), leadership=leadership)
        try:
            await self.scheduler.run(self.stop)
        finally:
            await state.client.aclose()

    @property
    def leadership(self) -> Leadership:
        scheduler = wait_for(lambda: self.scheduler, timeout=10, what="the scheduler")
        assert scheduler.leadership is not None
        return scheduler.leadership

    def freeze(self) -> None:
        self.thawed.clear()
        self.loop.call_soon_threadsafe(self.thawed.wait)

    def thaw(self) -> None:
        self.thawed.set()

    def close(self) -> None:
        self.thaw()
        if self.stop is not None:
            self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=20)
        assert not self.thread.is_alive(), f"{self.server}'s scheduler did not stop"


@contextmanager
def schedulers(redis_socket: Path, *servers: str) -> Iterator[list[Frozen]]:
    running = [Frozen(redis_socket, server) for server in servers]
    try:
        for each in running:
            each.thread.start()
        yield running
    finally:
        for each in running:
            each.close()


@asynccontextmanager
async def fresh_readings(state: State) -> AsyncIterator[None]:
    """memwatch's reading of the host's idle GPU, written each half second as it writes."""

    done = asyncio.Event()

    async def write() -> None:
        while not done.is_set():
            reading = idle_reading((24 * GiB, False)).model_copy(update={"taken_at": time.time()})
            await state.memory.write_reading(reading)
            await wait_event(done, 0.5)

    task = asyncio.create_task(write())
    try:
        yield
    finally:
        done.set()
        await task


async def launches(state: State) -> list[tuple[str, int, int | None]]:
    """The launches on the host's stream: (deployment, generation, epoch), oldest first."""
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]], await state.client.xrange(keys.host_commands(HOST))
    )
    found = []
    for _, fields in entries:
        command = hostcommands.parse(fields[b"command"])
        if isinstance(command, Launch):
            found.append((command.deployment, command.generation, hostcommands.epoch_of(fields)))
    return found


@pytest.mark.anyio
async def test_a_frozen_leader_is_replaced_within_the_bound_and_acts_no_more(
    redis_socket: Path,
) -> None:
    async with live_host(redis_socket, HOST) as state, fresh_readings(state):
        with schedulers(redis_socket, "s1", "s2") as (first, second):
            held = wait_for(
                lambda: first.leadership.held or second.leadership.held,
                timeout=10,
                what="a scheduler to take the lease",
            )
            assert held
            leading, waiting = (first, second) if first.leadership.held else (second, first)
            assert not waiting.leadership.held, "one holder"
            await state.deployments.put(declared("a", wanted="ready"))

            async def launched() -> list[tuple[str, int, int | None]]:
                return await launches(state)

            sent = await wait_for_async(launched, timeout=10, what="the leader's launch")
            assert sent == [("a", 1, leading.leadership.epoch)]

            leading.freeze()
            frozen_at = time.monotonic()
            wait_for(
                lambda: waiting.leadership.held, timeout=LEASE_S + RENEW_S + 5, what="a new leader"
            )
            took = time.monotonic() - frozen_at
            assert took <= LEASE_S + RENEW_S + 1, f"the new leader took {took:.1f} s"
            new_epoch = waiting.leadership.epoch
            assert new_epoch is not None
            assert new_epoch > (sent[0][2] or 0)
            # The new leader takes the deployment on: the deployment gone, its stop and a
            # launch of the one declared anew come under its epoch.
            await state.deployments.forget("a")
            await state.deployments.put(declared("b", wanted="ready"))
            await wait_for_async(
                lambda: _launched(state, "b"), timeout=10, what="the new leader's launch of b"
            )
            assert (await launches(state))[-1] == ("b", 1, new_epoch)

            leading.thaw()
            # The old leader finds its lease gone and plans no more.
            assert poll(lambda: leading.leadership.held, timeout=3) is None
            assert leading.leadership.epoch is None
            await state.deployments.forget("b")
            await state.deployments.put(declared("c", wanted="ready"))
            await wait_for_async(lambda: _launched(state, "c"), timeout=10, what="the launch of c")
            epochs = {epoch for name, _, epoch in await launches(state) if name != "a"}
            assert epochs == {new_epoch}, "only the new leader sent commands since"


async def _launched(state: State, name: str) -> bool:
    return any(deployment == name for deployment, _, _ in await launches(state))
