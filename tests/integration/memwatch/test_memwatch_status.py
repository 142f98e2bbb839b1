"""`capyctl status` shows a host's memory from memwatch's latest reading."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from capycommon import simgpu
from capycommon.domain.memory import GpuReading, HostRam, MemoryReading, StartupPeak
from capycommon.state import keys
from capycommon.state.stores import Blocking, State
from capyctl_cli.status import host_memory, render_memory
from integration.memwatch.helpers import GIB, Claimer
from support import Role, clean_env, role_running, wait_for

NOW = 1_800_000_000.0
GPU0 = simgpu.device_uuid("gpu0")


def reading(taken_at: float) -> MemoryReading:
    gpu = GpuReading(
        index=0,
        uuid=GPU0,
        name="gpu0",
        total_bytes=24 * GIB,
        used_bytes=6 * GIB,
        free_bytes=18 * GIB,
        unified=False,
        processes={123: 6 * GIB},
    )
    ram = HostRam(total_bytes=64 * GIB, available_bytes=60 * GIB, source="simulated")
    return MemoryReading(host="local", taken_at=taken_at, backend="simulated", gpus=[gpu], ram=ram)


def test_a_fresh_reading_is_shown_with_its_figures() -> None:
    shown = host_memory("local", reading(NOW - 1), NOW)
    assert shown.state == "observed"
    assert shown.reading_age_s == 1.0
    assert shown.backend == "simulated"
    (gpu,) = shown.gpus
    assert (gpu.total_bytes, gpu.used_bytes, gpu.free_bytes) == (24 * GIB, 6 * GIB, 18 * GIB)
    assert shown.ram is not None
    assert (shown.ram.total_bytes, shown.ram.used_bytes, shown.ram.available_bytes) == (
        64 * GIB,
        4 * GIB,
        60 * GIB,
    )
    lines = render_memory([shown]).splitlines()
    assert lines[0].split() == ["HOST", "MEMORY", "UUID", "TOTAL", "USED", "FREE", "SOURCE"]
    assert lines[1].split() == [
        "local",
        "gpu",
        "0",
        "gpu0",
        GPU0,
        "24.0",
        "GiB",
        "6.0",
        "GiB",
        "18.0",
        "GiB",
        "simulated",
    ]
    assert lines[2].split() == [
        "local",
        "host",
        "RAM",
        "-",
        "64.0",
        "GiB",
        "4.0",
        "GiB",
        "60.0",
        "GiB",
        "simulated",
    ]


@pytest.mark.parametrize(
    ("found", "age", "says"),
    [(None, None, "no reading"), (reading(NOW - 12), 12.0, "last reading 12s ago")],
)
def test_a_stale_or_missing_reading_is_unobserved(
    found: MemoryReading | None, age: float | None, says: str
) -> None:
    shown = host_memory("local", found, NOW)
    assert (shown.state, shown.reading_age_s, shown.gpus, shown.ram) == (
        "unobserved",
        age,
        [],
        None,
    )
    (_, row) = render_memory([shown]).splitlines()
    assert row.split()[:2] == ["local", "unobserved"]
    assert row.endswith(says)


def test_readings_and_peaks_are_read_back_or_none(redis_socket: Path) -> None:
    client = redis.Redis(unix_socket_path=str(redis_socket))
    blocking = Blocking(aioredis.Redis(unix_socket_path=str(redis_socket)))
    assert blocking(lambda s: s.memory.reading("local")) is None
    assert blocking(lambda s: s.memory.startup_peak("local", "chat", 1, "fp")) is None
    peak = StartupPeak(
        deployment="chat",
        revision=1,
        host="local",
        fingerprint="fp",
        device_bytes=GIB,
        host_bytes=2,
        measured_at=NOW,
        samples=4,
    )

    async def write_and_read() -> tuple[MemoryReading | None, StartupPeak | None]:
        state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
        try:
            await state.memory.write_reading(reading(NOW))
            await state.memory.write_startup_peak(peak)
            return (
                await state.memory.reading("local"),
                await state.memory.startup_peak("local", "chat", 1, "fp"),
            )
        finally:
            await state.client.aclose()

    assert asyncio.run(write_and_read()) == (reading(NOW), peak)
    assert blocking(lambda s: s.memory.reading("local")) == reading(NOW)
    assert blocking(lambda s: s.memory.startup_peak("local", "chat", 1, "fp")) == peak
    assert client.exists(keys.memory("local"), keys.startup_peak("local", "chat", 1, "fp")) == 2
    client.close()
    blocking.close()


@pytest.fixture
def simulated() -> Iterator[Role]:
    env = clean_env(
        CAPYCTL_SIMULATED_GPUS="gpu0:24GiB,gpu1:48GiB", CAPYCTL_SIMULATED_HOST_RAM="64GiB"
    )
    with role_running(env=env) as role:
        yield role


def test_status_shows_the_simulated_gpus_and_host_ram(simulated: Role) -> None:
    def observed() -> dict[str, object] | None:
        (host,) = simulated.status()["hosts"]
        return host if host["state"] == "observed" else None

    host = wait_for(observed, timeout=15, what="status to show an observed reading")
    assert host["host"] == "local"
    assert host["backend"] == "simulated"
    assert host["gpus"] == [
        {
            "index": 0,
            "uuid": GPU0,
            "name": "gpu0",
            "unified": False,
            "total_bytes": 24 * GIB,
            "used_bytes": 0,
            "free_bytes": 24 * GIB,
        },
        {
            "index": 1,
            "uuid": simgpu.device_uuid("gpu1"),
            "name": "gpu1",
            "unified": False,
            "total_bytes": 48 * GIB,
            "used_bytes": 0,
            "free_bytes": 48 * GIB,
        },
    ]
    assert host["ram"] == {
        "source": "simulated",
        "total_bytes": 64 * GIB,
        "used_bytes": 0,
        "available_bytes": 64 * GIB,
    }

    with Claimer(simulated.state_dir / "simgpu") as engine:
        engine.claim(GPU0, 5 * GIB, 3 * GIB)

        def claimed() -> str | None:
            text = simulated.capyctl("status").stdout
            return text if "5.0 GiB" in text else None

        text = wait_for(claimed, timeout=10, what="status to show the claimed memory")
    rows = {" ".join(line.split()[:4]): line.split() for line in text.splitlines()}
    gpu0, gpu1 = rows["local gpu 0 gpu0"], rows["local gpu 1 gpu1"]
    assert gpu0[4:] == [GPU0, "24.0", "GiB", "5.0", "GiB", "19.0", "GiB", "simulated"]
    assert gpu1[5:] == ["48.0", "GiB", "0", "B", "48.0", "GiB", "simulated"]
    assert rows["local host RAM -"][4:] == ["64.0", "GiB", "3.0", "GiB", "61.0", "GiB", "simulated"]
