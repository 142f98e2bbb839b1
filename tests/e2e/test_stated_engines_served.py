"""TensorFold and a custom engine on a standalone role, through the openai SDK: each starts on
demand, restart-only, charged what its deployment states; each gets the closed environment
and a per-launch key; a hung-up stream closes its connection to the engine and settles at
the next stop (CapyCTL reads no load from either)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster import Cluster, GiB, running
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine, install_tensorfold
from support import wait_for

# Slow enough to hang up on mid-answer.
SLOW = Behaviour(load_seconds=0.5, tokens_per_second=20, answer=" ".join(["word"] * 200))
TENSORFOLD = {
    "engine": "tensorfold",
    "model": "small",
    "engine_config": {"context_length": 4096, "max_concurrent_requests": 2},
    "resources": {"gpu": "6GiB", "ram": "2GiB"},
}
CUSTOM = {"engine": "served", "model": "small", "resources": {"gpu": "13GiB", "ram": "2GiB"}}
HI: list[Any] = [{"role": "user", "content": "Say hello"}]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with running("stated") as found:
        engines = found.root / "stated-engines"
        tensorfold = install_tensorfold(engines / "tf", "0.6.6", SLOW)
        found.ok("engine", "add", str(tensorfold))
        venv = install_python_engine(engines / "served", "vllm", "0.29.0", SLOW)
        command = (
            f"{venv}/bin/python -m vllm.entrypoints.openai.api_server --model {{model}} "
            "--host {host} --port {port} --served-model-name {served_name} "
            "--gpu-memory-utilization 0.5"
        )
        found.ok(
            "engine", "add-custom", "served", "--command", command, "--key-env", "VLLM_API_KEY"
        )
        yield found


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def _argv(pid: int) -> list[str]:
    return [word.decode() for word in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")][:-1]


def _launched(cluster: Cluster, name: str) -> tuple[list[str], dict[str, str], str]:
    """The engine's argv and environment, and its log."""
    instance = cluster.instance(name)
    assert instance is not None
    assert instance.process is not None
    assert instance.log_path
    pid = instance.process.pid
    return _argv(pid), _environ(pid), Path(instance.log_path).read_text(errors="replace")


def _hang_up_mid_answer(cluster: Cluster, name: str) -> None:
    stream = cluster.openai().chat.completions.create(model=name, messages=HI, stream=True)
    with stream:
        words = 0
        for chunk in stream:
            words += bool(chunk.choices and chunk.choices[0].delta.content)
            if words >= 3:
                break


def test_tensorfold_starts_on_demand_with_what_capyctl_sets(cluster: Cluster) -> None:
    cluster.deploy("tf", **TENSORFOLD)
    (binding,) = cluster.status("tf")["bindings"]
    assert binding["residency"] == "restart_only"
    assert binding["residency_reason"] == "tensorfold cannot park"
    reply = cluster.openai().chat.completions.create(model="tf", messages=HI, max_tokens=4)
    assert reply.choices[0].message.content
    argv, env, log = _launched(cluster, "tf")
    program = next(word for word in argv if word.endswith("/tf/tensorfold"))  # after its python
    assert argv[argv.index(program) + 1] == "serve"
    assert argv[argv.index("--parallel") + 1] == "2"
    assert argv[argv.index("--context-length") + 1] == "4096"
    assert env["TENSORFOLD_CUDA_MEMORY_LIMIT_GB"] == "6.00"
    assert env["TENSORFOLD_NO_UPDATE_CHECK"] == "1"
    assert env["TENSORFOLD_API_KEY"] not in (" ".join(argv), cluster.api_key)
    assert env["DO_NOT_TRACK"] == "1"
    assert env["PATH"].startswith(f"{Path(program).parent}:")
    assert "checking for updates" not in log
    charges = {
        (c["domain"], c["phase"]): (c["bytes"], c["provenance"])
        for c in cluster.status("tf")["charges"]
    }
    assert charges[("gpu0", "ready")] == (6 * GiB, "declared")
    assert charges[("system", "ready")] == (2 * GiB, "declared")


def test_a_custom_engine_runs_its_registered_command(cluster: Cluster) -> None:
    cluster.deploy("served-chat", **CUSTOM)
    reply = cluster.openai().chat.completions.create(model="served-chat", messages=HI, max_tokens=4)
    assert reply.choices[0].message.content
    argv, env, _ = _launched(cluster, "served-chat")
    instance = cluster.instance("served-chat")
    assert instance is not None
    assert instance.port is not None
    assert argv[2:] == [
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(cluster.root / "models" / "small"),
        "--host",
        "127.0.0.1",
        "--port",
        str(instance.port),
        "--served-model-name",
        "served-chat",
        "--gpu-memory-utilization",
        "0.5",
    ], shlex.join(argv)
    _, secret = cluster.engine("served-chat")
    assert env["VLLM_API_KEY"] == secret != cluster.api_key
    assert "CAPYCTL_API_KEY" not in env
    listed = [m.id for m in cluster.openai().models.list()]
    assert {"tf", "served-chat"} <= set(listed)


@pytest.mark.parametrize("name", ["tf", "served-chat"])
def test_a_hung_up_stream_settles_at_the_next_stop(cluster: Cluster, name: str) -> None:
    cluster.start(name)
    _hang_up_mid_answer(cluster, name)
    wait_for(
        lambda: cluster.status(name)["requests"]["settle_at_stop"] == 1,
        timeout=10,
        what="the cut request to count until the next stop",
    )
    if name == "served-chat":  # this engine's own metrics show the closed connection's effect
        wait_for(lambda: cluster.engine_running(name) == 0, timeout=5, what="the engine to stop")
    assert cluster.status(name)["requests"]["settle_when_idle"] == 0, "no idle reading comes"
    reply = cluster.openai().chat.completions.create(model=name, messages=HI, max_tokens=2)
    assert reply.choices[0].message.content, "the cut request does not hold the model up"
    cluster.ok("stop", "deployment", name, "--wait")
    cluster.start(name)
    assert cluster.status(name)["requests"]["settle_at_stop"] == 0, "the stop settled it"


def test_a_stated_engine_without_resources_is_refused_naming_the_fix(cluster: Cluster) -> None:
    document = cluster.root / "bare.yaml"
    bare = {"name": "bare", "engine": "tensorfold", "model": "small"}
    document.write_text(yaml.safe_dump({**bare, "engine_config": {"context_length": 1024}}))
    refused = cluster.cli("deploy", "model", "--file", str(document))
    assert refused.returncode == 2, refused.stderr
    assert "resources is required for tensorfold engines" in refused.stderr
    assert "resources: {gpu: 20GiB, ram: 4GiB}" in refused.stderr
    assert "invalid_config" in refused.stderr
    assert cluster.instance("bare") is None
    names = {row["name"] for row in json.loads(cluster.ok("list", "deployments", "--json"))}
    assert names == {"tf", "served-chat"}, "what was declared stays"
