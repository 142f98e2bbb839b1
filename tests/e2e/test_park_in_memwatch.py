"""The standalone role on simulated GPUs: hostd parks and wakes an engine, and memwatch's
reading shows the device memory go and come back; the launch's startup peak is measured."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import cast

import redis

from capycommon import keys, simgpu
from capycommon.hostcommands import Launch, Park, Stop, Wake
from capycommon.instances import InstanceRecord
from capycommon.memory import read_reading, read_startup_peak
from capycommon.testing.enginesim.behaviour import Behaviour
from capycommon.testing.enginesim.install import install_python_engine
from enginerun import sparse_model
from support import capyctl, clean_env, short_dir, start_role, wait_for

GiB = 1 << 30
BUDGET = 6 * GiB  # 0.25 of 24 GiB


def _state(client: redis.Redis, wanted: str) -> InstanceRecord | None:
    raw = cast(bytes | None, client.get(keys.instance("local", "demo", 0)))
    record = None if raw is None else InstanceRecord.model_validate_json(raw)
    return record if record is not None and record.state == wanted else None


def _used(client: redis.Redis, after: float) -> int | None:
    """gpu0's used bytes in a memwatch reading taken after `after`."""
    reading = read_reading(client, "local")
    if reading is None or reading.taken_at <= after:
        return None
    return reading.gpus[0].used_bytes


def _send(client: redis.Redis, command: Launch | Park | Wake | Stop) -> float:
    client.xadd(keys.host_commands("local"), {"command": command.model_dump_json()})
    return time.time()


def _cycle(client: redis.Redis, family: str, generation: int, model: Path, gpu: str) -> None:
    """Launch, park, wake and stop one engine, watching memwatch's readings."""
    launch = Launch(
        deployment="demo", generation=generation, revision=1, profile=family,
        model_path=str(model), served_name="demo", residency="host_backed",
        gpu_uuid=gpu, memory_fraction=0.25,
    )  # fmt: skip
    _send(client, launch)
    ready = wait_for(lambda: _state(client, "ready"), timeout=30, what=f"{family} ready")
    assert ready.generation == generation
    wait_for(lambda: _used(client, time.time() - 0.5) == BUDGET, timeout=10, what="the budget")

    parked_at = _send(client, Park(deployment="demo", generation=generation))
    wait_for(lambda: _state(client, "parked"), timeout=20, what="parked")
    wait_for(lambda: (u := _used(client, parked_at)) is not None and u < GiB, timeout=10,
             what="memwatch to see the device memory released")  # fmt: skip

    woke_at = _send(client, Wake(deployment="demo", generation=generation))
    wait_for(lambda: _state(client, "ready"), timeout=20, what="woken")
    wait_for(lambda: _used(client, woke_at) == BUDGET, timeout=10, what="memory back")

    stopped_at = _send(client, Stop(deployment="demo", generation=generation))
    wait_for(lambda: _state(client, "stopped"), timeout=20, what="stopped")
    wait_for(lambda: _used(client, stopped_at) == 0, timeout=10, what="the device empty")

    fingerprint = ready.fingerprint
    assert fingerprint is not None
    peak = wait_for(
        lambda: read_startup_peak(client, "local", "demo", 1, fingerprint),
        timeout=10,
        what="memwatch to store the launch's startup peak",
    )
    assert peak.provenance == "measured"
    # Sampled every 500 ms while starting: at least the weights, at most the budget.
    assert 2 * GiB <= peak.device_bytes <= BUDGET
    assert peak.samples >= 1


def test_park_and_wake_as_memwatch_sees_them(tmp_path: Path) -> None:
    root = short_dir("memwatch")
    state = root / "state"
    env = clean_env(
        HOME=str(root), CAPYCTL_SIMULATED_GPUS="gpu0:24GiB", CAPYCTL_SIMULATED_HOST_RAM="64GiB"
    )
    fast = Behaviour(load_seconds=1.0, tokens_per_second=200)
    for family, version in (("vllm", "0.29.0"), ("sglang", "0.5.16")):
        venv = install_python_engine(root / family, family, version, fast)  # type: ignore[arg-type]
        assert (
            capyctl("engine", "add", str(venv), "--state-dir", str(state), env=env).returncode == 0
        )
    model = sparse_model(root / "models" / "demo", 2 * GiB)
    (gpu,) = simgpu.parse_devices("gpu0:24GiB")
    role = start_role("standalone", state_dir=state, env=env)
    client = redis.Redis(unix_socket_path=str(state / "redis" / "redis.sock"))
    try:
        for generation, family in enumerate(("vllm", "sglang"), start=1):
            _cycle(client, family, generation, model, gpu.uuid)
    finally:
        client.close()
        role.stop()
        shutil.rmtree(root, ignore_errors=True)
