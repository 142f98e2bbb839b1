"""What the actuator writes for a switch, on a real redis-server: the switch is on its
deployment's record before its first victim is released, and a wait that adds nothing to it
is neither written again nor sent ahead of the victims' commands."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import pytest
import redis.asyncio as aioredis

from capycommon.domain.desired import Victim
from capycommon.state import keys
from capycommon.state.desired import CHOICE_FIELD
from capycommon.state.stores import State
from capyctl_scheduler.actions import Action
from capyctl_scheduler.actuator import Actuator
from capyctl_scheduler.snapshot import Snapshot
from integration.router.ready import put_deployment
from support import instance_record

HOST = "local"
VICTIM = Victim(deployment="b", generation=1)


@pytest.fixture
async def state(redis_socket: Path) -> AsyncIterator[State]:
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    for name in ("a", "b"):
        await put_deployment(state.client, name)
    yield state
    await state.client.aclose()


async def _snapshot(state: State) -> Snapshot:
    """The deployments as Redis holds them, with `b` ready: what the handlers read."""
    ready = instance_record("b", HOST, residency="host_backed")
    deployments = await state.deployments.all()
    return Snapshot(time.time(), deployments, {"b": ready}, {}, {})


async def _choices(state: State) -> list[tuple[str, str]]:
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], await state.client.xrange(keys.events()))
    found = [json.loads(fields[CHOICE_FIELD.encode()]) for _, fields in entries]
    return [(d["kind"], d["deployment"]) for d in found]


def _wait(reason: str) -> Action:
    return Action("wait", "a", reason, host=HOST, gpu="gpu0", victims=(VICTIM,))


def _stop(reason: str) -> Action:
    return Action("stop", "b", reason, host=HOST, generation=1, cause="switch")


@pytest.mark.anyio
async def test_a_switch_is_recorded_first_and_only_once(state: State) -> None:
    actuator = Actuator(state, _ack)
    await actuator.apply(await _snapshot(state), [_stop("for a"), _wait("b must go")])
    assert await _choices(state) == [("wait", "a"), ("stop", "b")], "the switch first"
    first = await state.deployments.get("a")
    assert first is not None
    assert first.switch is not None
    assert first.switch.victims == (VICTIM,)

    # The next tick: the same victim, the switch on the record already.
    await actuator.apply(await _snapshot(state), [_stop("for a, again"), _wait("b must go")])
    again = await state.deployments.get("a")
    assert again == first, "a wait that changes nothing is not written"
    assert (await _choices(state))[2:] == [("stop", "b")]

    # A new reason is written, after the victim's command.
    await actuator.apply(await _snapshot(state), [_wait("b is parking"), _stop("for a, once more")])
    assert (await _choices(state))[3:] == [("stop", "b"), ("wait", "a")]
    last = await state.deployments.get("a")
    assert last is not None
    assert last.switch == first.switch


async def _ack(deployment: str) -> None:
    """The demands' acknowledgement: none is open here."""
