"""The scheduler binds deployments from the facts hosts publish, over a real Redis: a model
path a host has not described is asked for on its command stream, and the binding waits,
saying why, until hostd answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path, PurePosixPath
from typing import cast

import pytest

from capycommon.domain.commands import Describe
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.models import ModelFacts
from capycommon.state import hostcommands, keys
from capycommon.state.stores import State
from capyctl_scheduler.observe import Observer
from capyctl_scheduler.policy import plan
from integration.scheduler.livehost import deployment_record, live_host
from support import wait_for_async
from unit.readings import GiB

HOST = "h1"


@pytest.fixture
async def state(redis_socket: Path) -> AsyncIterator[State]:
    """Redis as hostd left it: a live host with one engine and the model `small`."""
    async with live_host(redis_socket, HOST) as found:
        yield found


def record(name: str, model: str) -> DeploymentRecord:
    return deployment_record({"name": name, "engine": "vllm", "model": model})


async def describes(state: State) -> list[tuple[str, ...]]:
    """The Describe commands on the host's stream, oldest first."""
    entries = cast(
        list[tuple[bytes, dict[bytes, bytes]]], await state.client.xrange(keys.host_commands(HOST))
    )
    found = [hostcommands.parse(fields[b"command"]) for _, fields in entries]
    return [c.paths for c in found if isinstance(c, Describe)]


async def answer(state: State, facts: dict[str, ModelFacts]) -> None:
    """What hostd does with a Describe: publish the facts of the paths asked for."""
    models = await state.host_models.get(HOST)
    assert models is not None
    await state.host_models.publish(HOST, models.model_copy(update={"described": facts}))


@pytest.mark.anyio
async def test_a_path_the_host_has_not_described_waits_and_is_asked_for(
    state: State,
) -> None:
    await state.deployments.put(record("listed", "small"))
    await state.deployments.put(record("big", "/data/big"))
    observer = Observer(state, [HOST])
    snapshot = await observer.snapshot(demands={"big": 0.0})
    assert snapshot.bindings["listed"][HOST].resolved is not None, "the root's listing serves"
    waiting = snapshot.bindings["big"][HOST]
    assert (waiting.resolved, waiting.error) == (None, None)
    assert waiting.waiting == f"host {HOST} has not described model /data/big yet"
    assert await describes(state) == [("/data/big",)]
    (action,) = [a for a in plan(snapshot) if a.deployment == "big"]
    assert (action.kind, action.reason) == (
        "wait",
        f"no host can run it: {HOST}: host {HOST} has not described model /data/big yet",
    )

    await observer.snapshot()
    assert await describes(state) == [("/data/big",)], "asked once, not on every plan"

    big = ModelFacts(path="/data/big", kind="folder", weights_bytes=30 * GiB)
    await answer(state, {"/data/big": big})
    resolved = (await observer.snapshot()).bindings["big"][HOST].resolved
    assert resolved is not None
    assert (resolved.model_path, resolved.weights_bytes) == (PurePosixPath("/data/big"), 30 * GiB)

    await state.deployments.forget("big")
    await observer.snapshot()
    assert (await describes(state))[-1] == (), "a path no deployment names is let go"


@pytest.mark.anyio
async def test_declaring_waits_for_a_live_host_to_describe_the_model(
    state: State,
) -> None:
    async def hostd() -> None:
        await wait_for_async(
            lambda: describes(state), timeout=10, what="the scheduler's Describe", interval=0.02
        )
        gone = ModelFacts(path="/data/gone", kind="missing")
        await answer(state, {"/data/gone": gone})

    observer = Observer(state, [HOST])
    helper = asyncio.create_task(hostd())
    bindings = await observer.bindings_of(record("gone", "/data/gone"))
    await helper
    error = bindings[HOST].error
    assert error is not None
    assert (error.code, error.message) == (
        "not_found",
        "deployment 'gone': model: /data/gone does not exist; put the model there or fix model",
    )


@pytest.mark.anyio
async def test_a_host_whose_hostd_is_gone_is_not_waited_for(state: State) -> None:
    await state.client.delete(keys.heartbeat("hostd", HOST))
    observer = Observer(state, [HOST])
    started = asyncio.get_running_loop().time()
    bindings = await observer.bindings_of(record("later", "/data/later"))
    assert asyncio.get_running_loop().time() - started < 1
    assert bindings[HOST].waiting == f"host {HOST} has not described model /data/later yet"
    assert bindings[HOST].error is None, "declaring is not refused: it waits for the host"
