"""LMCache per instance through a real standalone role, with the simulator as vLLM 0.32.0 and
the project's LMCache stand-in, both in one environment, and the openai SDK as the client:
registered with `capyctl engine add`, on by default for a restart_only deployment (status
says so, and what it is charged), a prompt seen before answered from the cache, across a
restart_only park too (the server runs on while the engine is stopped); off with the gate
named where a condition fails, and `lmcache: required` refused there; the server gone once
the deployment is."""

from __future__ import annotations

import json

import pytest
import yaml

from capycommon.domain.instances import InstanceRecord
from cluster import SMALL, Cluster
from enginesim.behaviour import Behaviour
from enginesim.install import install_lmcache, install_python_engine
from support import group_members, wait_for

# Longer than two chunks of 256 tokens, however the simulator counts its tokens.
LONG = " ".join(f"word{i}" for i in range(1200))


@pytest.fixture(scope="module")
def registered(one_gpu: Cluster) -> str:
    """vLLM 0.32.0 with LMCache 0.5.6 in its environment, registered as `v32` and `lmc`."""
    venv = install_python_engine(
        one_gpu.root / "e" / "v32", "vllm", "0.32.0", Behaviour(load_seconds=0.3)
    )
    install_lmcache(venv, "0.5.6")
    both = one_gpu.cli("engine", "add", str(venv))
    assert both.returncode == 17, both.stderr
    assert "holds lmcache and vllm; choose one with --family" in both.stderr
    one_gpu.ok("engine", "add", str(venv), "--family", "vllm", "--name", "v32")
    added = json.loads(
        one_gpu.ok("engine", "add", str(venv), "--family", "lmcache", "--name", "lmc", "--json")
    )
    assert added["profile"]["family"] == "lmcache"
    assert added["profile"]["version"] == "0.5.6"
    return "v32"


def cached_tokens(cluster: Cluster, name: str, content: str) -> int:
    answer = cluster.openai().chat.completions.create(
        model=name, messages=[{"role": "user", "content": content}], max_tokens=4
    )
    assert answer.usage is not None
    details = answer.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def binding(cluster: Cluster, name: str) -> dict[str, object]:
    (found,) = cluster.status(name)["bindings"]
    assert isinstance(found, dict)
    return found


def server_of(cluster: Cluster, name: str) -> InstanceRecord:
    found = cluster.instance(name)
    assert found is not None
    assert found.cache is not None
    return found


def test_a_restart_only_model_answers_from_its_cache_across_a_park(
    cluster: Cluster, registered: str
) -> None:
    cluster.deploy(
        "lm", engine=registered, model="small", residency="restart_only", engine_config=SMALL
    )
    note = str(binding(cluster, "lm")["lmcache"])
    assert note.startswith("on: LMCache 0.5.6 (lmc), pool 4.0 GiB"), note
    assert "the server's estimated" in note or "the server's measured" in note
    assert cached_tokens(cluster, "lm", LONG) == 0
    assert cached_tokens(cluster, "lm", LONG) > 0, "the same prompt again, from the cache"
    cache = server_of(cluster, "lm").cache
    assert cache is not None
    charges = cluster.status("lm")["charges"]
    system = next(c for c in charges if c["domain"] == "system")
    assert system["bytes"] >= cache.pool_bytes, "the pool is charged in host RAM"
    cluster.ok("park", "deployment", "lm", "--wait")
    parked = server_of(cluster, "lm")
    assert parked.state == "stopped"
    assert parked.cache == cache, "the server was kept, and is still charged"
    assert group_members(cache.process.pgid), "the server runs on"
    assert cluster.status("lm")["state"] == "parked"
    assert cached_tokens(cluster, "lm", LONG) > 0, "answered from the cache after the park"
    again = server_of(cluster, "lm")
    assert again.generation == parked.generation + 1
    assert again.cache is not None
    assert again.cache.process == cache.process, "the same server, connected to again"
    cluster.ok("delete", "deployment", "lm", "--wait")
    wait_for(lambda: not group_members(cache.process.pgid), timeout=30, what="the server to stop")


def test_a_closed_gate_runs_without_lmcache_or_refuses_a_required_one(
    cluster: Cluster, registered: str
) -> None:
    cluster.deploy("deep", engine=registered, model="small", residency="deep", engine_config=SMALL)
    note = str(binding(cluster, "deep")["lmcache"])
    assert note.startswith("off: its residency is deep"), note
    assert note.endswith("[residency]"), note
    assert cached_tokens(cluster, "deep", "hi") == 0
    found = cluster.instance("deep")
    assert found is not None
    assert found.cache is None
    cluster.deploy(
        "zero", engine=registered, model="small", residency="restart_only", retention="zero"
    )
    assert str(binding(cluster, "zero")["lmcache"]).endswith("[retention_zero]")
    must = {
        "name": "must",
        "engine": registered,
        "model": "small",
        "residency": "deep",
        "lmcache": "required",
    }
    document = cluster.root / "must.yaml"
    document.write_text(yaml.safe_dump(must))
    refused = cluster.cli("deploy", "model", "--file", str(document))
    assert refused.returncode == 5, refused.stderr
    assert "error [lmcache_unavailable:residency]" in refused.stderr
    assert "lmcache: required, but its residency is deep" in refused.stderr
    assert "set residency: restart_only" in refused.stderr
    names = {row["name"] for row in json.loads(cluster.ok("list", "deployments", "--json"))}
    assert "must" not in names, "refused before it was declared"


def test_lmcache_off_on_a_deployment_is_honoured(cluster: Cluster, registered: str) -> None:
    cluster.deploy(
        "plain", engine=registered, model="small", residency="restart_only", lmcache="off"
    )
    assert binding(cluster, "plain")["lmcache"] == "off (lmcache: off)"
    assert cached_tokens(cluster, "plain", "hi") == 0
    found = cluster.instance("plain")
    assert found is not None
    assert found.cache is None
