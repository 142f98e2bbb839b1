"""The router's metrics from the hosts' events, against a real Redis: a download that ended
before the follower began is still counted (events are read from the router's start), and a
follower that starts again, as a restarted worker does, counts nothing twice."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from capycommon.domain.instances import Event
from capycommon.state.stores import State
from capyctl_router.metrics import Metrics, start_cursors

HOST = "gpu-m"


def download(received: int) -> Event:
    return Event(
        kind="download",
        host=HOST,
        deployment="",
        instance=0,
        generation=0,
        reason="test",
        duration_s=2.0,
        at=time.time(),
        repo="acme/tiny",
        received_bytes=received,
        outcome="done",
    )


def received(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value(
        "capyctl_download_bytes_total", {"host": HOST, "repo": "acme/tiny"}
    )


async def follow_until(metrics: Metrics, state: State, folder: Path, bytes_: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(metrics.follow_events(state, lambda: {HOST}, stop, folder))
    deadline = time.monotonic() + 10
    while received(metrics) != bytes_ and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stop.set()
    await task


@pytest.mark.anyio
async def test_events_are_counted_once_from_the_routers_start(
    redis_socket: Path, tmp_path: Path
) -> None:
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    try:
        await state.events.note(download(100))  # before the router started: not its to count
        await asyncio.sleep(0.01)
        start_cursors(tmp_path)
        await asyncio.sleep(0.01)
        await state.events.note(download(1000))  # before its first worker follows the events
        first = Metrics()
        await follow_until(first, state, tmp_path, 1000)
        assert received(first) == 1000

        await state.events.note(download(7))  # while no worker follows them
        again = Metrics()
        await follow_until(again, state, tmp_path, 7)
        assert received(again) == 7, "the restarted worker went on from where the first stopped"
        assert (
            again.registry.get_sample_value(
                "capyctl_download_seconds_count",
                {"host": HOST, "repo": "acme/tiny", "outcome": "done"},
            )
            == 1
        )
    finally:
        await state.client.aclose()
