"""Residency end to end: a host with deep parking off, and a checkpoint SGLang cannot park.

Each role runs on simulated GPUs with the engine simulator installed as vLLM and SGLang."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
import yaml

from cluster import HOST, Cluster, GiB
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from support import capyctl, clean_env, short_dir, start_role, wait_for

SMALL = {"memory": {"request": "4GiB", "startup": "5GiB"}}
NVFP4 = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4"}}


def _role(prefix: str, gpus: str, *extra: str) -> Iterator[Cluster]:
    root = short_dir(prefix)
    state = root / "state"
    env = clean_env(
        HOME=str(root), CAPYCTL_SIMULATED_GPUS=gpus, CAPYCTL_SIMULATED_HOST_RAM="256GiB"
    )
    fast = Behaviour(load_seconds=0.5, tokens_per_second=200)
    families: tuple[tuple[Literal["vllm", "sglang"], str], ...] = (
        ("vllm", "0.29.0"),
        ("sglang", "0.5.16"),
    )
    for family, version in families:
        install = install_python_engine(root / "e" / family, family, version, fast)
        added = capyctl(
            "engine", "add", str(install), "--name", family, "--state-dir", str(state), env=env
        )
        assert added.returncode == 0, added.stderr
    sparse_model(root / "models" / "small", 2 * GiB)
    nvfp4 = sparse_model(root / "models" / "nvfp4", 2 * GiB)
    (nvfp4 / "hf_quant_config.json").write_text(json.dumps(NVFP4))
    cluster = Cluster(start_role("standalone", state_dir=state, env=env, extra=extra), root)
    try:
        yield cluster
    finally:
        cluster.clean()
        cluster.close()
        cluster.role.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def no_deep_park() -> Iterator[Cluster]:
    yield from _role("dpoff", "unified:128GiB", "--deep-park", "off")


@pytest.fixture(scope="module")
def discrete() -> Iterator[Cluster]:
    yield from _role("nvfp4", "gpu0:24GiB")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().partition("=")[::2] for item in raw if item)


def test_a_model_that_would_park_deep_stops_instead(no_deep_park: Cluster) -> None:
    cluster = no_deep_park
    idle = {"ready_idle_timeout": "2s", "parked_idle_timeout": "never"}
    cluster.deploy("dp", model="small", engine_config=SMALL, lifecycle=idle)
    (binding,) = cluster.status("dp")["bindings"]
    assert binding["residency"] == "restart_only"
    assert binding["residency_reason"] == (
        "unified memory: a host copy would take the GPU's own memory; deep parking is off on "
        "this host (host.deep_park: off), so it stops instead of parking"
    )
    assert binding["deep_park"] is False
    # Each row of the text status: its key, the column's padding, its value.
    rows = {
        key: value
        for key, _, value in (
            line.partition("  ") for line in cluster.ok("status", "deployment", "dp").splitlines()
        )
    }
    assert rows["residency"].lstrip().startswith("restart_only on local (unified memory:")
    assert rows["deep parking"].lstrip() == "off on host local (host.deep_park: off)"

    cluster.start("dp")
    instance = cluster.instance("dp")
    assert instance is not None
    assert instance.residency == "restart_only"
    assert instance.process is not None
    assert "VLLM_SERVER_DEV_MODE" not in _environ(instance.process.pid)
    cmdline = Path(f"/proc/{instance.process.pid}/cmdline").read_bytes().split(b"\0")
    assert b"--enable-sleep-mode" not in cmdline

    wait_for(lambda: cluster.state("dp") == "stopped", timeout=60, what="the idle model to stop")
    states = [to for _, to, _ in cluster.transitions("dp")]
    assert "parking" not in states
    assert "parked" not in states
    assert "stopping" in states


def test_a_declared_deep_park_resolves_to_restart_only_there(no_deep_park: Cluster) -> None:
    no_deep_park.deploy(
        "declared", model="small", engine="sglang", residency="deep", engine_config=SMALL
    )
    (binding,) = no_deep_park.status("declared")["bindings"]
    assert (binding["residency"], binding["residency_reason"]) == (
        "restart_only",
        "declared deep, but deep parking is off on this host (host.deep_park: off); it stops "
        "instead",
    )


def test_sglang_refuses_to_park_an_nvfp4_checkpoint(discrete: Cluster) -> None:
    document = discrete.root / "fp4.yaml"
    document.write_text(
        yaml.safe_dump(
            {
                "name": "fp4",
                "engine": "sglang",
                "model": "nvfp4",
                "residency": "deep",
                "engine_config": SMALL,
            }
        )
    )
    result = discrete.cli("deploy", "model", "--file", str(document))
    assert result.returncode == 5, result.stderr
    folder = discrete.root / "models" / "nvfp4"
    assert result.stderr == (
        "error [capability_missing:deep_park]: deployment 'fp4': residency: deep: sglang "
        "cannot park a ModelOpt FP4 (NVFP4) checkpoint, and the model is one "
        f"({folder}/hf_quant_config.json: quantization.quant_algo NVFP4); set residency: "
        "restart_only (or drop residency)\n"
    )
    assert discrete.cli("status", "deployment", "fp4").returncode == 2, "nothing was declared"

    discrete.deploy("fp4", model="nvfp4", engine="sglang", engine_config=SMALL)
    (binding,) = discrete.status("fp4")["bindings"]
    assert binding["residency"] == "restart_only"
    assert "sglang cannot park a ModelOpt FP4 (NVFP4) checkpoint" in binding["residency_reason"]
    assert binding["deep_park"] is True

    discrete.deploy("fp4-vllm", model="nvfp4", engine="vllm", residency="deep", engine_config=SMALL)
    (binding,) = discrete.status("fp4-vllm")["bindings"]
    assert (binding["residency"], binding["residency_reason"]) == ("deep", "declared")
    assert binding["host"] == HOST
