"""Stopping the role stops CapyCTL's processes but leaves running engines alone; the next
start re-adopts them."""

from __future__ import annotations

import json
import os
import shutil
import signal
from typing import cast

import openai
import redis

from capycommon.domain.instances import InstanceRecord
from capycommon.state import keys
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from support import capyctl, clean_env, group_members, short_dir, start_role, wait_for

GiB = 1 << 30


def _record(client: redis.Redis) -> InstanceRecord | None:
    raw = cast(bytes | None, client.get(keys.instance("local", "demo", 0)))
    return None if raw is None else InstanceRecord.model_validate_json(raw)


def test_a_restart_of_the_role_keeps_the_engine_running() -> None:
    root = short_dir("survive")
    home, state = root / "home", root / "state"
    env = clean_env(HOME=str(home), CAPYCTL_SIMULATED_GPUS="gpu0:24GiB")
    fast = Behaviour(load_seconds=0.3, tokens_per_second=200)
    venv = install_python_engine(root / "vllm", "vllm", "0.29.0", fast)
    assert capyctl("engine", "add", str(venv), "--state-dir", str(state), env=env).returncode == 0
    sparse_model(home / "models" / "demo", 2 * GiB)
    document = root / "demo.yaml"
    document.write_text("name: demo\nengine: vllm\nmodel: demo\n")
    role = start_role("standalone", state_dir=state, env=env)
    client = redis.Redis(unix_socket_path=str(state / "redis" / "redis.sock"))
    pgid = 0
    try:
        assert role.capyctl("deploy", "model", "--file", str(document), "--wait").returncode == 0
        ready = _record(client)
        assert ready is not None
        assert ready.state == "ready"
        assert ready.process is not None
        pgid = ready.process.pgid
        client.close()
        assert role.stop() == 0
        assert group_members(pgid), "the engine outlived the role"

        again = start_role("standalone", state_dir=state, env=env)
        client = redis.Redis(unix_socket_path=str(state / "redis" / "redis.sock"))
        wait_for(lambda: "re-adopted" in again.output(), timeout=15, what="re-adoption")
        assert _record(client) == ready, "re-adopted as it was, and the scheduler left it alone"
        key = cast(bytes, client.get(keys.instance_secret("local", "demo", 0))).decode()
        engine = openai.OpenAI(base_url=f"http://127.0.0.1:{ready.port}/v1", api_key=key)
        assert (
            engine.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "hi"}]
            )
            .choices[0]
            .message.content
        )
        assert again.capyctl("stop", "deployment", "demo", "--wait").returncode == 0
        assert group_members(pgid) == []
        events = [
            json.loads(f[b"event"])
            for _, f in cast(
                list[tuple[bytes, dict[bytes, bytes]]], client.xrange(keys.host_events("local"))
            )
        ]
        assert [e["to_state"] for e in events if e["kind"] == "transition"][-2:] == [
            "stopping",
            "stopped",
        ]
        again.stop()
    finally:
        client.close()
        role.stop()
        if pgid and group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
