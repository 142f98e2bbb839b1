"""What a wake, a start and a drain wait on in hostd: the engine's own calls, hostd's account
of each step, and the drain's load reading the scheduler waits for."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from capycommon.domain.commands import Park, Wake
from capycommon.domain.instances import InstanceState
from capycommon.domain.notifications import Notification
from capycommon.state import notify
from capycommon.state.stores import State
from enginesim.install import write_behaviour
from integration.hostd.harness import FAST, HOST, Hostd, launch
from support import wait_for


def _steps(harness: Hostd, message: str) -> list[dict[str, float]]:
    """The `steps` of each of hostd's log lines saying `message`."""
    found = []
    for line in harness.log.read_text().splitlines():
        try:
            entry: dict[str, Any] = json.loads(line)
        except ValueError:
            continue
        if entry.get("message") == message and "steps" in entry.get("fields", {}):
            found.append(entry["fields"]["steps"])
    return found


def test_hostd_logs_each_step_of_a_start_and_a_wake(hostd: tuple[Hostd, str], model: Path) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model))
    ready = harness.wait_state("a", "ready")
    harness.send(Park(deployment="a", generation=1))
    harness.wait_state("a", "parked")
    harness.send(Wake(deployment="a", generation=1))
    woken = harness.wait_state("a", "ready")

    (started,) = wait_for(lambda: _steps(harness, "started"), timeout=5, what="the start's steps")
    assert list(started) == ["received", "spawned", "healthy", "canary"]
    assert sorted(started.values()) == list(started.values()), "in the order they happened"
    assert started["canary"] <= ready.since, "the canary passed before it was ready"

    (wake,) = wait_for(lambda: _steps(harness, "woke"), timeout=5, what="the wake's steps")
    assert list(wake) == ["received", "wake call", "woke", "canary"]
    assert sorted(wake.values()) == list(wake.values()), "in the order they happened"
    assert wake["canary"] <= woken.since, "the canary passed before it was ready"
    reasons = [e["reason"] for e in harness.events() if e.get("to_state") == "ready"]
    assert reasons[-1] == "ready after wake: wake calls and canary passed"


def test_a_wake_past_its_deadline_fails(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    write_behaviour(installs["vllm"], FAST.model_copy(update={"wake_seconds": 5}))
    harness.send(launch("a", 1, gpu, model))
    harness.wait_state("a", "ready")
    harness.send(Park(deployment="a", generation=1))
    harness.wait_state("a", "parked")
    harness.send(Wake(deployment="a", generation=1, wake_deadline_s=1))
    failed = harness.wait_state("a", "failed")
    assert failed.error == "wake failed: not awake within 1 s"


def test_a_drain_is_read_at_once_and_the_reading_announced(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    """The scheduler parks a draining engine once a load reading taken after the drain
    began shows it idle: hostd reads it when the drain is notified, and says it wrote it."""
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model))
    harness.wait_state("a", "ready")
    wait_for(lambda: "a:0" in harness.loads(), timeout=5, what="a's first reading")
    announced = asyncio.run(_drain_and_listen(harness))
    assert announced.kind == "load"
    assert announced.id == HOST
    draining = harness.record("a")
    assert draining is not None
    assert draining.state == "draining"
    assert harness.loads()["a:0"].read_at > draining.since, "read after the drain began"


async def _drain_and_listen(harness: Hostd) -> Notification:
    """Drain a:0 as the scheduler does; the first load notification after it."""
    client = aioredis.Redis(unix_socket_path=str(harness.redis_socket))
    try:
        channels = [name for name, host in notify.channels([HOST]).items() if host]
        async with notify.subscribed(client, channels) as pubsub:
            store = State(client).instances(HOST)
            ready = await store.get("a", 0)
            assert ready is not None
            await store.transition(
                ready.model_copy(update={"state": InstanceState.DRAINING, "since": time.time()}),
                allowed=[InstanceState.READY],
                generation=ready.generation,
                reason="drain: test",
                previous=ready,
            )
            async with asyncio.timeout(10):
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1)
                    if message is None:
                        continue
                    note = Notification.model_validate_json(message["data"])
                    if note.kind == "load":
                        return note
    finally:
        await client.aclose()
