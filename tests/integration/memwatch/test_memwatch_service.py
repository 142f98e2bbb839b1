"""memwatch as a real process against a real redis-server, with simulated GPUs and RAM."""

from __future__ import annotations

import itertools
import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from capycommon import simgpu
from capycommon.domain.instances import InstanceRecord, InstanceState
from capycommon.domain.memory import STALE_AFTER_S, MemoryReading, StartupPeak
from capycommon.domain.notifications import Notification
from capycommon.state import keys
from capycommon.state.stores import Blocking
from integration.memwatch.helpers import GIB, Claimer, record
from support import clean_env, service_command, short_dir, wait_for

SPEC = "gpu0:24GiB,gpu1:24GiB;gpu0-gpu1:nvlink"
GPU0, GPU1 = simgpu.device_uuid("gpu0"), simgpu.device_uuid("gpu1")


@dataclass
class Memwatch:
    proc: subprocess.Popen[bytes]
    state: Path
    log: Path
    client: redis.Redis
    # The records memwatch writes, read as the services read them.
    blocking: Blocking

    @property
    def simgpu(self) -> Path:
        return self.state / "simgpu"

    def reading(self) -> MemoryReading | None:
        return self.blocking(lambda s: s.memory.reading("local"))

    def newer_reading(self, than: float) -> MemoryReading | None:
        found = self.reading()
        return found if found is not None and found.taken_at > than else None

    def logged(self, message: str) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.log.read_text().splitlines() if line]
        return [line["fields"] for line in lines if line["message"] == message]


@pytest.fixture
def memwatch(redis_socket: Path) -> Iterator[Memwatch]:
    state = short_dir("mw")
    log = state / "memwatch.log"
    env = clean_env(
        CAPYCTL_REDIS_URL=f"unix://{redis_socket}",
        CAPYCTL_SIMULATED_GPUS=SPEC,
        CAPYCTL_SIMULATED_HOST_RAM="64GiB",
        CAPYCTL_LOG_LEVEL="debug",
        CAPYCTL_HOST_NAME="local",
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(service_command("memwatch", state), env=env, stderr=out)
    client = redis.Redis(unix_socket_path=str(redis_socket))
    blocking = Blocking(aioredis.Redis(unix_socket_path=str(redis_socket)))
    try:
        yield Memwatch(proc, state, log, client, blocking)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        proc.kill()
        proc.wait()
        client.close()
        blocking.close()
        shutil.rmtree(state, ignore_errors=True)


def test_devices_json_and_a_fresh_reading_every_two_seconds(memwatch: Memwatch) -> None:
    first = wait_for(memwatch.reading, timeout=15, what="memwatch's first reading")
    devices = simgpu.read_devices(memwatch.simgpu)
    assert [(d.name, d.uuid, d.total_bytes) for d in devices] == [
        ("gpu0", GPU0, 24 * GIB),
        ("gpu1", GPU1, 24 * GIB),
    ]
    assert simgpu.parse_devices("gpu0:1GiB")[0].uuid == GPU0, "the same name, the same UUID"
    taken = [first.taken_at]
    for _ in range(3):
        later = wait_for(lambda: memwatch.newer_reading(taken[-1]), 5, "the next reading")
        assert later.is_fresh(time.time())
        assert time.time() - later.taken_at < 2
        taken.append(later.taken_at)
    gaps = [b - a for a, b in itertools.pairwise(taken)]
    # Two readings within a reading's freshness, so one late never leaves the host unobserved.
    assert all(0 < gap < STALE_AFTER_S / 2 for gap in gaps), gaps
    assert 1.6 < (taken[-1] - taken[0]) / len(gaps) < 2.4, gaps
    assert first.backend == "simulated"
    assert first.host == "local"
    assert [g.used_bytes for g in first.gpus] == [0, 0]
    assert [g.links for g in first.gpus] == [{GPU1: "nvlink"}, {GPU0: "nvlink"}]
    assert (first.ram.total_bytes, first.ram.available_bytes) == (64 * GIB, 64 * GIB)
    assert first.ram.source == "simulated"
    assert not first.is_fresh(first.taken_at + STALE_AFTER_S + 0.1)


def used(memwatch: Memwatch) -> tuple[list[int], int] | None:
    """(device bytes used per GPU, host RAM available) of the latest reading."""
    found = memwatch.reading()
    return (
        None if found is None else ([g.used_bytes for g in found.gpus], found.ram.available_bytes)
    )


def test_a_reading_sums_the_claims_of_live_processes_only(memwatch: Memwatch) -> None:
    wait_for(memwatch.reading, timeout=15, what="memwatch's first reading")
    with Claimer(memwatch.simgpu) as one, Claimer(memwatch.simgpu) as two:
        one.claim(GPU0, 3 * GIB, 2 * GIB)
        two.claim(GPU0, 5 * GIB, GIB)
        two.child(GPU1, 4 * GIB, 0)
        expected = ([8 * GIB, 4 * GIB], 61 * GIB)
        wait_for(lambda: used(memwatch) == expected, 10, "a reading of the three claims")
        reading = memwatch.reading()
        assert reading is not None
        gpu0, gpu1 = reading.gpus
        assert gpu0.processes == {one.pid: 3 * GIB, two.pid: 5 * GIB}
        assert gpu1.processes == {two.pids()[1]: 4 * GIB}
        assert (gpu0.free_bytes, gpu1.free_bytes) == (16 * GIB, 20 * GIB)

        two.kill()  # SIGKILL: its claims stay on disk, but no live process holds them
        assert (memwatch.simgpu / f"{two.pid}.json").exists()
        expected = ([3 * GIB, 0], 62 * GIB)
        wait_for(lambda: used(memwatch) == expected, 10, "the dead process's claims to drop")


def peak_of(memwatch: Memwatch) -> StartupPeak | None:
    """The startup peak stored for revision 3 of chat, built fp-1."""
    return memwatch.blocking(lambda s: s.memory.startup_peak("local", "chat", 3, "fp-1"))


def put(client: redis.Redis, found: InstanceRecord) -> None:
    """Write an instance record and announce it, as hostd's every transition does."""
    client.set(keys.instance("local", found.deployment, found.instance), found.model_dump_json())
    client.sadd(keys.instances("local"), found.member)
    note = Notification(kind="instance", id=found.member, version=found.generation)
    client.publish(keys.host_notifications("local"), note.model_dump_json())


@pytest.mark.parametrize("quiet_s", [0.0, 3.0], ids=["at-once", "after-a-quiet-longer-than-2s"])
def test_a_startup_peak_is_measured_while_starting(memwatch: Memwatch, quiet_s: float) -> None:
    wait_for(lambda: memwatch.logged("watching launches"), 15, "the sampler's first step")
    # With nothing starting, memwatch waits for hostd's announcement; a launch announced
    # after a quiet longer than a blind gap is still watched whole.
    time.sleep(quiet_s)
    client = memwatch.client
    with Claimer(memwatch.simgpu) as engine:
        starting = record(InstanceState.STARTING, engine.identity(), since=time.time())
        put(client, starting)

        def rose_to(device: int, host: int) -> bool:
            return any(
                (f["device_bytes"], f["host_bytes"]) == (device, host)
                for f in memwatch.logged("startup peak rose")
            )

        # The group spans both GPUs: its figure is the most it holds on one of them.
        engine.claim(GPU0, GIB, GIB)
        engine.child(GPU1, 2 * GIB, 0)
        wait_for(lambda: rose_to(2 * GIB, GIB), 10, "a sample of 2 GiB on its fuller GPU")
        engine.claim(GPU0, 6 * GIB, 4 * GIB)
        wait_for(lambda: rose_to(6 * GIB, 4 * GIB), 10, "a sample of the 6 GiB peak")
        engine.claim(GPU0, 3 * GIB, 2 * GIB)
        wait_for(lambda: used(memwatch) == ([3 * GIB, 2 * GIB], 62 * GIB), 10, "the drop")
        assert peak_of(memwatch) is None

        ready = starting.model_copy(update={"state": InstanceState.READY, "since": time.time()})
        put(client, ready)
        peak = wait_for(
            lambda: peak_of(memwatch),
            10,
            "the startup peak to be stored",
        )
    assert (peak.device_bytes, peak.host_bytes) == (6 * GIB, 4 * GIB), "not the 8 GiB summed"
    assert (peak.deployment, peak.revision, peak.host, peak.fingerprint) == (
        "chat",
        3,
        "local",
        "fp-1",
    )
    assert peak.provenance == "measured"
    assert peak.samples >= 3
    assert peak.measured_at >= ready.since
    assert memwatch.logged("startup peak measured")[0]["device_bytes"] == 6 * GIB
    assert any(f["devices"] == 2 for f in memwatch.logged("startup peak rose"))


def _readings_over(memwatch: Memwatch, seconds: float) -> int:
    """How many readings memwatch announced on the host's memory channel within `seconds`,
    each written before it was announced."""
    pubsub = memwatch.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
    pubsub.subscribe(keys.memory_notifications("local"))
    try:
        while pubsub.get_message(timeout=1) is not None:
            pass  # the subscription is confirmed
        seen: set[int] = set()
        until = time.monotonic() + seconds
        while (left := until - time.monotonic()) > 0:
            message = pubsub.get_message(timeout=left)
            if message is None:
                continue
            note = Notification.model_validate_json(message["data"])
            if note.kind == "reading":
                written = memwatch.reading()
                assert written is not None
                assert int(written.taken_at * 1000) >= note.version
                seen.add(note.version)
        return len(seen)
    finally:
        pubsub.close()


def _ask(client: redis.Redis, member: str) -> None:
    """Ask for readings, as hostd does once an engine's park call returned."""
    note = Notification(kind="verify", id=member, version=int(time.time() * 1000))
    client.publish(keys.memory_notifications("local"), note.model_dump_json())


def test_readings_come_every_10_ms_once_hostd_asks_while_an_instance_parks(
    memwatch: Memwatch,
) -> None:
    """A park counts only once a reading taken after the engine's park call shows the memory
    released, so a switch waiting on it would wait up to 2 s for the next reading."""
    wait_for(lambda: memwatch.logged("watching launches"), 15, "the sampler's first step")
    client = memwatch.client
    with Claimer(memwatch.simgpu) as engine:
        ready = record(InstanceState.READY, engine.identity(), since=time.time())
        put(client, ready)
        assert _readings_over(memwatch, 2.0) <= 2, "one every 2 s while nothing parks"

        parking = ready.model_copy(update={"state": InstanceState.PARKING, "since": time.time()})
        put(client, parking)
        assert _readings_over(memwatch, 2.0) <= 2, "one every 2 s while the park call runs"

        _ask(client, parking.member)
        assert _readings_over(memwatch, 1.0) >= 40, "about one every 10 ms once asked"

        parked = ready.model_copy(update={"state": InstanceState.PARKED, "since": time.time()})
        put(client, parked)
        wait_for(
            lambda: _readings_over(memwatch, 0.2) == 0,
            timeout=10,
            what="memwatch to take up the park's announcement and read every 2 s",
        )
        assert _readings_over(memwatch, 2.0) <= 2, "one every 2 s again once it parked"
