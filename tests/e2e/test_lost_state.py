"""A role whose Redis lost its data (the append-only file deleted) stops the engines it finds
running with no record, so no memory is left uncounted and a redeploy starts one engine."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import cast

import redis

from capycommon import simgpu
from capycommon.state import keys
from capycommon.state.instances import InstanceRecord
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from support import (
    Role,
    capyctl,
    clean_env,
    group_members,
    live_processes,
    processes_mentioning,
    short_dir,
    start_role,
    wait_for,
)

GiB = 1 << 30


def _ready(role: Role, document: Path) -> InstanceRecord:
    """Deploy the model and return its ready instance record."""
    assert role.capyctl("deploy", "model", "--file", str(document), "--wait").returncode == 0
    client = redis.Redis(unix_socket_path=str(role.state_dir / "redis" / "redis.sock"))
    try:
        raw = cast(bytes | None, client.get(keys.instance("local", "demo", 0)))
    finally:
        client.close()
    assert raw is not None
    record = InstanceRecord.model_validate_json(raw)
    assert record.state == "ready"
    assert record.process is not None
    return record


def _engine_groups(model: Path) -> set[int]:
    """The process groups of every engine serving `model`."""
    return {p.pgid for p in live_processes() if str(model) in p.cmdline}


def _gpu_used(state: Path) -> int:
    return sum(usage.used_bytes for usage in simgpu.usage(state / "simgpu").values())


def test_a_role_whose_redis_lost_its_data_leaves_no_engine_uncounted() -> None:
    root = short_dir("lost")
    home, state = root / "home", root / "state"
    env = clean_env(HOME=str(home), CAPYCTL_SIMULATED_GPUS="gpu0:24GiB")
    fast = Behaviour(load_seconds=0.3, tokens_per_second=200)
    venv = install_python_engine(root / "vllm", "vllm", "0.29.0", fast)
    assert capyctl("engine", "add", str(venv), "--state-dir", str(state), env=env).returncode == 0
    model = home / "models" / "demo"
    sparse_model(model, 2 * GiB)
    document = root / "demo.yaml"
    document.write_text("name: demo\nengine: vllm\nmodel: demo\n")
    role = start_role("standalone", state_dir=state, env=env)
    groups: set[int] = set()
    try:
        first = _ready(role, document)
        assert first.process is not None
        launch_id = first.launch_id
        assert launch_id is not None
        groups.add(first.process.pgid)
        one_engine = _gpu_used(state)
        assert one_engine > 0
        assert role.stop() == 0
        assert group_members(first.process.pgid), "the engine outlived the role"

        shutil.rmtree(state / "redis" / "appendonly")
        role = start_role("standalone", state_dir=state, env=env)
        wait_for(
            lambda: not processes_mentioning(launch_id),
            timeout=30,
            what="the old launch's engine and log writer to be stopped",
        )
        assert group_members(first.process.pgid) == []
        assert _gpu_used(state) == 0, "its memory is released"
        assert "its record was lost with Redis's data" in (state / "logs" / "hostd.log").read_text()

        second = _ready(role, document)
        assert second.process is not None
        groups.add(second.process.pgid)
        assert second.launch_id != launch_id
        assert _engine_groups(model) == {second.process.pgid}, "exactly one engine runs"
        assert _gpu_used(state) == one_engine
        assert role.capyctl("stop", "deployment", "demo", "--wait").returncode == 0
        assert role.stop() == 0
    finally:
        role.stop()
        for pgid in groups:
            if group_members(pgid):
                os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
