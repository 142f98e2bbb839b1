"""The scheduler end to end: `capyctl start standalone` on simulated GPUs with the engine
simulator (real processes), driven by the CLI and the management API."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import cast

import httpx
import openai
import pytest
import yaml

from capycommon.domain.instances import LIVE_STATES
from capycommon.state import keys
from cluster import FOURTEEN, HOST, SMALL, Cluster, GiB
from support import holds_for, wait_for


def test_three_14gib_models_take_turns_on_one_24gib_gpu(cluster: Cluster) -> None:
    for name in "abc":
        cluster.deploy(name, engine_config=FOURTEEN)
    order = ["a", "b", "c", "a", "c", "b"]
    for name in order:
        assert "ready" in cluster.ok("start", "deployment", name, "--wait")
        others = {other: cluster.state(other) for other in "abc" if other != name}
        assert "ready" not in others.values(), f"two 14 GiB models on one card: {others}"
    for name in "abc":
        states = [to for _, to, _ in cluster.transitions(name)]
        assert "failed" not in states, f"{name} was refused: {cluster.transitions(name)}"
        assert states.count("starting") == 2, "started once (and the process noted once)"
        assert "parked" in states
        assert "waking" in states
    listing = cluster.ok("list", "deployments")
    assert listing.splitlines()[0].split() == [
        "NAME",
        "STATE",
        "READY",
        "REVISION",
        "HOSTS",
        "GPUS",
    ]
    status = cluster.status("b")
    assert status["state"] == "ready"
    assert status["startup"]["device_provenance"] == "declared"
    assert status["startup"]["host_provenance"] in ("measured", "derived")
    charges = {c["domain"]: c for c in status["charges"]}
    assert charges["gpu0"]["bytes"] == 14 * GiB
    assert charges["gpu0"]["phase"] == "ready"
    assert charges["system"]["bytes"] >= 4 * GiB + 15 * GiB, "host overhead and the host copy"
    assert status["last_operation"]["reason"]
    (instance,) = status["instances"]
    assert (instance["host"], instance["gpu"], instance["state"]) == (HOST, "gpu0", "ready")


def test_park_and_wake_at_each_residency(cluster: Cluster) -> None:
    small = {"memory": {"request": "4GiB", "startup": "5GiB"}}
    cluster.deploy("hb", model="small", engine_config=small)
    cluster.deploy("deep", model="small", residency="deep", engine="sglang", engine_config=small)
    cluster.deploy(
        "ro", model="gguf", engine="llama", engine_config={"context_length": 4096, **small}
    )
    for name, tier in (("hb", "host_backed"), ("deep", "deep")):
        cluster.start(name)
        assert "parked" in cluster.ok("park", "deployment", name, "--wait")
        assert cluster.instance(name).residency == tier  # type: ignore[union-attr]
        assert "ready" in cluster.ok("start", "deployment", name, "--wait")
        reasons = [reason for _, to, reason in cluster.transitions(name) if to == "parked"]
        assert reasons
        assert f"parked ({tier})" in reasons[0]
    cluster.start("ro")
    assert "parked" in cluster.ok("park", "deployment", "ro", "--wait"), "a restart_only park"
    assert cluster.state("ro") == "stopped", "it parks by stopping"


def test_a_request_after_an_operator_park_wakes_it_for_good(cluster: Cluster) -> None:
    cluster.deploy("p", model="small", engine_config=SMALL)
    cluster.start("p")
    assert "parked" in cluster.ok("park", "deployment", "p", "--wait")
    client = openai.OpenAI(base_url=cluster.base_url, api_key=cluster.api_key, max_retries=0)
    answer = client.chat.completions.create(
        model="p", messages=[{"role": "user", "content": "hi"}], max_tokens=1, timeout=60
    )
    assert answer.choices[0].finish_reason
    # The scheduler parked it again within a second of the demand's end before; it now
    # stays ready like any demanded model (its idle timeout is the role's 5 minutes).
    holds_for(lambda: cluster.state("p") == "ready", 3, "p ready")
    woke = [to for _, to, _ in cluster.transitions("p")]
    assert woke[-2:] == ["waking", "ready"]
    assert cluster.declared()["p"].park_requested is None, "the park was done"


def test_idle_models_park_then_stop(cluster: Cluster) -> None:
    cluster.deploy(
        "idle",
        model="small",
        lifecycle={"ready_idle_timeout": "2s", "parked_idle_timeout": "2s"},
        engine_config={"memory": {"request": "4GiB"}},
    )
    cluster.start("idle")
    wait_for(lambda: cluster.state("idle") == "stopped", timeout=30, what="idle park then stop")
    reasons = [(to, reason) for _, to, reason in cluster.transitions("idle")]
    assert ("draining", "drain: idle for 2s") in reasons
    assert ("stopping", "stop: parked idle for 2s") in reasons
    assert cluster.status("idle")["state"] == "idle", "an idle stop keeps it on demand"


def _slow_request(cluster: Cluster, name: str, tokens: int) -> threading.Thread:
    """A request straight to the engine, running about tokens/8 seconds."""
    instance = cluster.instance(name)
    assert instance is not None
    assert instance.port is not None
    secret = cast(bytes, cluster.client.get(keys.instance_secret(HOST, name, 0))).decode()

    def send() -> None:
        httpx.post(
            f"http://127.0.0.1:{instance.port}/v1/chat/completions",
            headers={"Authorization": f"Bearer {secret}"},
            json={
                "model": name,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": tokens,
                "ignore_eos": True,
            },
            timeout=60,
        )

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_busy_victim_is_waited_for(cluster: Cluster) -> None:
    cluster.deploy("busy", engine="slow", engine_config=FOURTEEN)
    cluster.deploy("next", engine_config=FOURTEEN)
    cluster.start("busy")
    # About 25 s at 8 tokens/s: still running when a loaded machine's scheduler gets to it.
    request = _slow_request(cluster, "busy", tokens=200)
    wait_for(lambda: cluster.status("busy")["state"] == "ready", timeout=5, what="ready")
    wait_for(
        lambda: cluster.status("busy")["requests"]["engine_running"] >= 1,
        timeout=12,
        what="hostd's load reading to show the request",
    )
    cluster.ok("start", "deployment", "next")
    wait_for(
        lambda: any(
            "1 busy, warm or explicit kept" in d["reason"] for d in cluster.choices("next")
        ),
        timeout=20,
        what="the switch to wait for the busy model",
    )
    assert cluster.state("busy") == "ready", "a model with requests in flight is no victim"
    request.join(timeout=45)
    done_at = time.time()
    wait_for(lambda: cluster.state("next") == "ready", timeout=30, what="the switch")
    assert cluster.state("busy") == "parked"
    drained = [e for e in cluster.events("busy") if e.to_state == "draining"]
    assert drained
    assert drained[-1].at >= done_at - 1.5, "drained only once its request ended"


def test_a_park_that_frees_no_memory_stops_the_engine(cluster: Cluster) -> None:
    cluster.deploy(
        "leaky", engine="leaky", model="small", engine_config={"memory": {"request": "4GiB"}}
    )
    cluster.start("leaky")
    pgid = cluster.instance("leaky").process.pgid  # type: ignore[union-attr]
    cluster.ok("park", "deployment", "leaky")
    wait_for(lambda: cluster.state("leaky") == "stopped", timeout=30, what="leaky stopped")
    stops = [reason for _, to, reason in cluster.transitions("leaky") if to == "stopping"]
    assert stops
    assert "memory not released" in stops[0]
    assert "on gpu0" in stops[0]
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_wait_exit_codes(cluster: Cluster) -> None:
    cluster.deploy(
        "crashy", engine="crashy", model="small", engine_config={"memory": {"request": "4GiB"}}
    )
    failed = cluster.cli("start", "deployment", "crashy", "--wait")
    assert failed.returncode == 13, failed.stderr
    assert "error [launch_failed]" in failed.stderr
    assert "simulated crash" in failed.stderr
    cluster.ok("stop", "deployment", "crashy")
    cluster.deploy(
        "slowload", engine="slowload", model="small", engine_config={"memory": {"request": "4GiB"}}
    )
    timed_out = cluster.cli("start", "deployment", "slowload", "--wait", "--timeout", "2")
    assert timed_out.returncode == 10, timed_out.stderr
    assert "error [activation_timeout]" in timed_out.stderr
    cluster.ok("stop", "deployment", "slowload", "--wait")
    cluster.deploy("huge", engine_config={"memory": {"request": "30GiB"}})
    began = time.monotonic()
    too_big = cluster.cli("start", "deployment", "huge", "--wait", "--timeout", "60")
    assert too_big.returncode == 4, too_big.stderr
    assert time.monotonic() - began < 30, "refused at once, not at the timeout"
    assert "error [insufficient_resources]: huge cannot run on gpu0: needs" in too_big.stderr


def test_an_operator_stop_suspends_on_demand_activation(cluster: Cluster) -> None:
    cluster.deploy("op", model="small", engine_config={"memory": {"request": "4GiB"}})
    cluster.start("op")
    assert "stopped" in cluster.ok("stop", "deployment", "op", "--wait")
    cluster.demand("op")
    wait_for(
        lambda: any(d["kind"] == "drop_demand" for d in cluster.choices("op")),
        timeout=10,
        what="the scheduler to drop the demand",
    )
    assert cluster.state("op") == "stopped", "a demand does not start an operator-stopped model"
    assert cluster.status("op")["state"] == "stopped"
    assert "ready" in cluster.ok("start", "deployment", "op", "--wait")


def test_drain_stops_every_engine_and_keeps_deployments_on_demand(cluster: Cluster) -> None:
    small = {"memory": {"request": "4GiB"}}
    cluster.deploy("d1", model="small", engine_config=small)
    cluster.deploy("d2", model="small", engine_config=small)
    cluster.start("d1")
    cluster.start("d2")
    assert "stopping d1, d2" in cluster.ok("drain", "standalone")
    wait_for(
        lambda: {cluster.state("d1"), cluster.state("d2")} == {"stopped"},
        timeout=30,
        what="both stopped",
    )
    assert cluster.status("d1")["state"] == "idle"
    assert "ready" in cluster.ok("start", "deployment", "d1", "--wait")


def test_the_scheduler_killed_mid_switch_neither_double_charges_nor_orphans(
    cluster: Cluster,
) -> None:
    cluster.deploy("x", engine_config=FOURTEEN)
    cluster.deploy("y", engine_config=FOURTEEN)
    cluster.start("x")
    cluster.ok("start", "deployment", "y")
    # x drains and parks in a few hundred ms (memwatch reads every 20 ms after the park call);
    # y's start, which follows, takes longer: the kill lands in the switch either way.
    wait_for(
        lambda: cluster.state("x") in ("draining", "parking", "parked"),
        timeout=20,
        what="the switch to begin",
    )
    scheduler = cluster.role.processes()["scheduler"]["pid"]
    os.kill(scheduler, signal.SIGKILL)
    wait_for(cluster.role.healthy, timeout=30, what="supervisord to restart it")
    wait_for(lambda: cluster.state("y") == "ready", timeout=60, what="the switch to finish")
    assert cluster.state("x") == "parked"
    live = [m.decode() for m in cast(set[bytes], cluster.client.smembers(keys.instances(HOST)))]
    running = [
        name
        for name in live
        if (found := cluster.instance(name.split(":")[0])) and found.state in LIVE_STATES
    ]
    assert sorted(running) == ["x:0", "y:0"], "one engine each, none orphaned"
    hosts = json.loads(cluster.ok("list", "hosts", "--json"))
    gpu0 = next(d for d in hosts[0]["domains"] if d["name"] == "gpu0")
    # Parked, x (vLLM 0.29 on a 24 GiB card) keeps its CUDA context (612 MiB) and its graph
    # pool (512 sequences, 2 MiB each); y is ready at 14 GiB.
    parked = (612 << 20) + 512 * (2 << 20)
    assert gpu0["charged"] == parked + 14 * GiB, "x parked and y ready, once each"
    starts = [to for _, to, _ in cluster.transitions("y") if to == "starting"]
    assert len(starts) == 2, "y launched once (the second is its process noted)"


def test_refusals_name_the_problem(cluster: Cluster) -> None:
    cluster.deploy("taken", model="small", routes=["shared"])
    cases = [
        ({"name": "u", "engine": "vllm", "model": "small", "colour": "red"}, 2, "invalid_config"),
        (
            {
                "name": "u",
                "engine": "vllm",
                "model": "small",
                "engine_config": {"memory": {"request": 14}},
            },
            2,
            "invalid_config",
        ),
        (
            {
                "name": "u",
                "engine": "vllm",
                "model": "small",
                "engine_config": {"env": {"CUDA_VISIBLE_DEVICES": "1"}},
            },
            2,
            "engine_env_reserved:CUDA_VISIBLE_DEVICES",
        ),
        (
            {"name": "u", "engine": "vllm", "model": "small", "routes": ["shared"]},
            2,
            "route_conflict",
        ),
        (
            {
                "name": "u",
                "engine": "llama",
                "model": "gguf",
                "engine_config": {"tensor_parallel": 2, "context_length": 4096},
            },
            5,
            "not_enough_gpus",
        ),
        (
            {
                "name": "u",
                "engine": "llama",
                "model": "gguf",
                "residency": "deep",
                "engine_config": {"context_length": 4096},
            },
            5,
            "capability_missing:deep_park",
        ),
        ({"name": "u", "engine": "nosuch", "model": "small"}, 24, "profile_not_published"),
        ({"name": "u", "engine": "vllm", "model": "missing"}, 2, "not_found"),
        (
            {"name": "u", "engine": "vllm", "model": "small", "devices": [{"id": "gpu3"}]},
            2,
            "invalid_config",
        ),
    ]
    for document, code, name in cases:
        path = cluster.root / "bad.yaml"
        path.write_text(yaml.safe_dump(document))
        result = cluster.cli("deploy", "model", "--file", str(path))
        assert (result.returncode, f"error [{name}]") == (code, result.stderr.split("]")[0] + "]")
        assert "u" not in cluster.declared(), "nothing declared"
    assert list(cluster.declared()) == ["taken"], "what was declared stays"


def test_the_management_api_acts_once_per_idempotency_key(cluster: Cluster) -> None:
    token = cluster.role.credentials()["admin_token"]
    base = f"http://{cluster.role.management}/management/v1"
    auth = {"Authorization": f"Bearer {token}"}
    body = {"document": {"name": "idem", "engine": "vllm", "model": "small"}}
    with httpx.Client(base_url=base, headers=auth) as http:
        missing = http.post("/deployments", json=body)
        assert missing.status_code == 400
        assert missing.json()["error"]["code"] == "invalid_request"
        first = http.post("/deployments", json=body, headers={"Idempotency-Key": "k1"})
        again = http.post("/deployments", json=body, headers={"Idempotency-Key": "k1"})
        assert first.status_code == again.status_code == 202
        assert first.json() == again.json()
        changed = {"document": {**body["document"], "routes": ["other"]}}
        conflict = http.post("/deployments", json=changed, headers={"Idempotency-Key": "k1"})
        assert conflict.status_code == 409
        assert conflict.json()["error"]["code"] == "idempotency_conflict"
        update = http.post("/deployments", json=changed, headers={"Idempotency-Key": "k2"})
        assert update.json()["revision"] == 2
        assert update.json()["change"] == "updated"
        same = http.post("/deployments", json=changed, headers={"Idempotency-Key": "k3"})
        assert same.json()["revision"] == 2
        assert same.json()["change"] == "unchanged"
        bad = http.post(
            "/deployments", json={"document": {"name": "Bad!"}}, headers={"Idempotency-Key": "k4"}
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_config"
        wrong = httpx.get(f"{base}/deployments", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
