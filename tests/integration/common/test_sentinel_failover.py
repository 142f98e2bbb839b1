"""A service's client of replicated servers' Redis across the loss of the primary: its Redis
and its Sentinel killed (SIGKILL) while the client writes, the Sentinels elect another, and
writes go on there after a bounded outage that the service's REDIS_ERRORS handling rides
out, logged once; the router's pipe of that client runs its scripts again there too. No
write the client saw succeed is lost: each answer counts on from the last.

A former primary that still runs (an operator's failover, or one that froze and resumed) is
left within seconds, by the client and its pipe alike, well before the Sentinels make it a
replica and it drops what it took meanwhile."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from capycommon.service import redis_client
from capycommon.state.pipe import Pipe, Script
from sentinels import (
    OUTAGE_BOUND_S,
    Servers,
    Writer,
    across_a_failover,
    replicated_servers,
)
from support import cancel, wait_for_async

COUNTER = Script.of("return redis.call('INCRBY', KEYS[1], ARGV[1])")
# How soon a client leaves a former primary the Sentinels no longer name (they ask every
# second); the Sentinels make it a replica no sooner than 8 s after.
LEAVE_BOUND_S = 5.0


@pytest.mark.anyio
async def test_a_client_writes_on_across_the_loss_of_the_primary(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="capycommon.service")
    with replicated_servers() as servers:
        client = redis_client(servers.control_target())
        try:
            writer = Writer(lambda: client.incr("capyctl:failover-counter"))
            outage = await across_a_failover(servers, writer)
        finally:
            await client.aclose()
    assert outage < OUTAGE_BOUND_S
    said = [record.getMessage() for record in caplog.records]
    assert said.count("lost Redis; reconnecting") == 1, said
    assert said.count("reconnected to Redis") == 1, said


@pytest.mark.anyio
async def test_the_pipe_runs_its_scripts_on_the_new_primary() -> None:
    with replicated_servers() as servers:
        client = redis_client(servers.control_target())
        try:
            pipe = Pipe.of(client)

            async def take() -> int:
                answer = await pipe.run(COUNTER, ["capyctl:failover-pipe"], [1])
                assert isinstance(answer, int)
                return answer

            outage = await across_a_failover(servers, Writer(take))
            assert Pipe.of(client) is pipe  # the pool's one pipe, through the failover
        finally:
            await client.aclose()
    assert outage < OUTAGE_BOUND_S


@pytest.mark.anyio
async def test_the_client_and_its_pipe_leave_a_former_primary_that_runs_on() -> None:
    with replicated_servers() as servers:
        client = redis_client(servers.control_target())
        pipe = Pipe.of(client)

        async def by_script() -> int:
            answer = await pipe.run(COUNTER, ["capyctl:switch-pipe"], [1])
            assert isinstance(answer, int)
            return answer

        writers = {
            "capyctl:switch-client": Writer(lambda: client.incr("capyctl:switch-client")),
            "capyctl:switch-pipe": Writer(by_script),
        }
        tasks = [asyncio.create_task(writer.run()) for writer in writers.values()]
        try:

            async def writing() -> bool:
                return all(len(writer.answers) >= 10 for writer in writers.values())

            await wait_for_async(writing, 10, "writes to the first primary")
            former = servers.primary()
            await asyncio.to_thread(servers.switch_over)

            async def named() -> str | None:
                found = await asyncio.to_thread(servers.primary)
                return found if found not in (None, former) else None

            primary = await wait_for_async(named, 10, "the Sentinels to name another")
            since = time.monotonic()

            async def moved() -> bool:
                return await asyncio.to_thread(_written_on, servers, primary, writers, since)

            await wait_for_async(moved, LEAVE_BOUND_S, "writes on the new primary")
            assert await asyncio.to_thread(servers.role, former or "") == "master"
            assert not any(task.done() for task in tasks)  # no failure outside REDIS_ERRORS
        finally:
            for task in tasks:
                await cancel(task)
            await client.aclose()


def _written_on(servers: Servers, primary: str, writers: dict[str, Writer], since: float) -> bool:
    """Whether each writer's last answer, given after `since`, came from `primary`: the
    former primary counts on from where `primary` took over, so its answers are higher."""
    with servers.direct(primary) as found:
        for key, writer in writers.items():
            at, last = writer.answers[-1]
            value = found.get(key)
            if at <= since or value is None or int(value) < last:
                return False
    return True
