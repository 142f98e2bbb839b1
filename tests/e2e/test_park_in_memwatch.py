"""The standalone role on simulated GPUs: a deployment is started, parked, woken and stopped,
and memwatch's reading shows the device memory go and come back; the launch's startup peak
is measured."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import redis.asyncio as aioredis

from capycommon.domain.instances import InstanceRecord
from capycommon.state.stores import Blocking
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from support import Role, capyctl, clean_env, short_dir, start_role, wait_for

GiB = 1 << 30
# What each engine takes for a 6 GiB request on a 24 GiB card. vLLM is told 0.25 of the card;
# SGLang 0.26 of what is free once its CUDA context exists (6 GiB of 23.4, rounded up to a
# hundredth), and the simulator, which has no context, takes 0.26 of the 24 GiB free.
BUDGETS = {"vllm": 6 * GiB, "sglang": int(0.26 * 24 * GiB)}


def _state(state: Blocking, name: str, wanted: str) -> InstanceRecord | None:
    record = state(lambda s: s.instances("local").get(name, 0))
    return record if record is not None and record.state == wanted else None


def _used(state: Blocking, after: float) -> int | None:
    """gpu0's used bytes in a memwatch reading taken after `after`."""
    reading = state(lambda s: s.memory.reading("local"))
    if reading is None or reading.taken_at <= after:
        return None
    return reading.gpus[0].used_bytes


def _cycle(role: Role, state: Blocking, family: str) -> None:
    """Start, park, wake and stop one deployment, watching memwatch's readings."""
    name, budget = f"demo-{family}", BUDGETS[family]
    assert role.capyctl("start", "deployment", name, "--wait").returncode == 0
    ready = _state(state, name, "ready")
    assert ready is not None
    wait_for(lambda: _used(state, time.time() - 0.5) == budget, timeout=10, what="the budget")

    parked_at = time.time()
    assert role.capyctl("park", "deployment", name, "--wait").returncode == 0
    wait_for(
        lambda: (u := _used(state, parked_at)) is not None and u < GiB,
        timeout=10,
        what="memwatch to see the device memory released",
    )

    woke_at = time.time()
    assert role.capyctl("start", "deployment", name, "--wait").returncode == 0
    wait_for(lambda: _used(state, woke_at) == budget, timeout=10, what="memory back")

    stopped_at = time.time()
    assert role.capyctl("stop", "deployment", name, "--wait").returncode == 0
    wait_for(lambda: _used(state, stopped_at) == 0, timeout=10, what="the device empty")

    fingerprint = ready.fingerprint
    assert fingerprint is not None
    peak = wait_for(
        lambda: state(lambda s: s.memory.startup_peak("local", name, 1, fingerprint)),
        timeout=10,
        what="memwatch to store the launch's startup peak",
    )
    assert peak.provenance == "measured"
    # Sampled every 500 ms while starting: at least the weights, at most the budget.
    assert 2 * GiB <= peak.device_bytes <= budget
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
        # A 6 GiB request: the engine is given a quarter of the 24 GiB card.
        (root / f"{family}.yaml").write_text(
            f"name: demo-{family}\nengine: {family}\nmodel: demo\nresidency: host_backed\n"
            "engine_config: {memory: {request: 6GiB}}\n"
        )
    sparse_model(root / "models" / "demo", 2 * GiB)
    role = start_role("standalone", state_dir=state, env=env)
    blocking = Blocking(aioredis.Redis(unix_socket_path=str(state / "redis" / "redis.sock")))
    try:
        for family in ("vllm", "sglang"):
            assert (
                role.capyctl("deploy", "model", "--file", str(root / f"{family}.yaml")).returncode
                == 0
            )
            _cycle(role, blocking, family)
    finally:
        blocking.close()
        role.stop()
        shutil.rmtree(root, ignore_errors=True)
