"""The scheduler's loop over a real redis-server, with a hostd slow to read its command
stream (none reads it here): a command is sent once and answered by what hostd says of that
command alone. A deployment deleted is stopped once, not again on every plan until hostd gets
there (hostd would refuse the second stop); and a refusal of an earlier deployment of the same
name, whose generations started from 1 too, refuses no launch of the new one, which would
otherwise be started again as generation 2 while hostd starts generation 1."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest

from capycommon.domain.commands import Launch, Stop
from capycommon.domain.desired import DeploymentRecord
from capycommon.state import hostcommands, keys
from capycommon.state.stores import State
from capyctl_scheduler.loop import Scheduler
from capyctl_scheduler.observe import Observer
from integration.scheduler.livehost import deployment_record, live_host
from support import instance_record
from unit.readings import GiB, idle_reading

HOST = "local"


@pytest.fixture
async def state(redis_socket: Path) -> AsyncIterator[State]:
    """Redis as a live host left it: one engine, the model `small`, one idle 24 GiB GPU."""
    async with live_host(redis_socket, HOST) as found:
        yield found


async def tick(state: State, scheduler: Scheduler) -> None:
    """One turn of the loop, on a fresh reading of the GPU (as memwatch writes each second)."""
    reading = idle_reading((24 * GiB, False)).model_copy(update={"taken_at": time.time()})
    await state.memory.write_reading(reading)
    await scheduler.tick()


def declared(name: str, **record: Any) -> DeploymentRecord:
    """`name` serving `small`, started and kept ready by the operator (no request needed)."""
    written = {
        "name": name,
        "engine": "vllm",
        "model": "small",
        "lifecycle": {"activation": "explicit"},
    }
    return deployment_record(written, **record)


async def sent(state: State) -> list[tuple[str, str, int]]:
    """The commands on the host's stream: (kind, deployment, generation), oldest first."""
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]], await state.client.xrange(keys.host_commands(HOST))
    )
    found = [hostcommands.parse(fields[b"command"]) for _, fields in entries]
    return [(c.kind, c.deployment, c.generation) for c in found if isinstance(c, Launch | Stop)]


@pytest.mark.anyio
async def test_a_refusal_of_an_earlier_deployment_of_the_name_refuses_no_launch(
    state: State,
) -> None:
    store = state.instances(HOST)
    # What hostd said of the deployment `a` deleted a moment ago: its second stop came late.
    await store.refused("a", 0, 1, "stop refused: no such instance on this host")
    scheduler = Scheduler(state, Observer(state, [HOST]))
    await state.deployments.put(declared("a", wanted="ready"))
    await tick(state, scheduler)
    assert await sent(state) == [("launch", "a", 1)]
    for _ in range(3):  # hostd has not read its stream yet
        await tick(state, scheduler)
    assert await sent(state) == [("launch", "a", 1)], "one launch, and no generation 2"
    record = await state.deployments.get("a")
    assert record is not None
    assert record.generation == 1
    assert record.inflight is not None
    assert (record.inflight.kind, record.inflight.generation) == ("launch", 1)
    # A refusal of this launch, once hostd reads it, ends it.
    await store.refused("a", 0, 1, "launch refused: the instance is starting; stop it first")
    await tick(state, scheduler)
    record = await state.deployments.get("a")
    assert record is not None
    assert record.inflight is None or record.inflight.generation == 2


@pytest.mark.anyio
async def test_a_deleted_deployment_is_stopped_once(state: State) -> None:
    store = state.instances(HOST)
    ready = instance_record("b", HOST, gpu_uuid="GPU-0", residency="host_backed")
    await store.transition(ready, allowed=["absent"], generation=None, reason="launch: test")
    await state.deployments.put(declared("b", generation=1, host=HOST, deleting=True))
    scheduler = Scheduler(state, Observer(state, [HOST]))
    await tick(state, scheduler)
    assert await sent(state) == [("stop", "b", 1)]
    for _ in range(3):  # hostd has not read its stream yet
        await tick(state, scheduler)
    assert await sent(state) == [("stop", "b", 1)], "stopped once"
