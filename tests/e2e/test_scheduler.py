"""The scheduler end to end: `capyctl start standalone` on simulated GPUs with the engine
simulator (real processes), driven by the CLI and the management API."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
import redis.asyncio as aioredis
import yaml

from capycommon import desired, keys
from capycommon.instances import LIVE_STATES, InstanceRecord
from capycommon.store import Event
from capycommon.testing.enginesim.behaviour import Behaviour, CrashAtStart, Faults
from capycommon.testing.enginesim.install import install_llama_server, install_python_engine
from enginerun import sparse_model
from support import Role, capyctl, clean_env, short_dir, start_role, wait_for

GiB = 1 << 30
HOST = "local"
# Every model here is charged 14 GiB on its card: a 12.75 GiB request and 1.25 GiB of CUDA
# context; two never fit on one 24 GiB GPU (22.1 GiB managed), so each start is a switch.
FOURTEEN = {"memory": {"request": "13056MiB", "startup": "14GiB"}}


@dataclass
class Cluster:
    """One standalone role and the engines and models it serves."""

    role: Role
    root: Path

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return capyctl(
            *args, "--state-dir", str(self.role.state_dir), env=self.role.env, timeout=timeout
        )

    def ok(self, *args: str, timeout: float = 120) -> str:
        result = self.cli(*args, timeout=timeout)
        assert result.returncode == 0, f"capyctl {' '.join(args)}: {result.stderr}"
        return result.stdout

    def deploy(self, name: str, **fields: Any) -> None:
        document = {"name": name, "engine": "vllm", "model": "m14", **fields}
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(document))
        self.ok("deploy", "model", "--file", str(path))

    def status(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.ok("status", "deployment", name, "--json"))
        return data

    @property
    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=str(self.role.state_dir / "redis" / "redis.sock"))

    def instance(self, name: str) -> InstanceRecord | None:
        raw = cast(bytes | None, self.client.get(keys.instance(HOST, name, 0)))
        return None if raw is None else InstanceRecord.model_validate_json(raw)

    def state(self, name: str) -> str | None:
        found = self.instance(name)
        return None if found is None else str(found.state)

    def events(self, name: str) -> list[Event]:
        """hostd's events of a deployment's instance, oldest first."""
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(keys.host_events(HOST))
        )
        found = (Event.model_validate_json(fields[b"event"]) for _, fields in entries)
        return [event for event in found if event.deployment == name]

    def decisions(self, name: str) -> list[dict[str, Any]]:
        """The scheduler's decisions about a deployment, oldest first."""
        entries = cast(list[tuple[bytes, dict[bytes, bytes]]], self.client.xrange(keys.events()))
        found = (json.loads(fields[b"event"]) for _, fields in entries)
        return [decision for decision in found if decision["deployment"] == name]

    def transitions(self, name: str) -> list[tuple[str | None, str | None, str]]:
        return [
            (e.from_state, e.to_state, e.reason)
            for e in self.events(name)
            if e.kind == "transition"
        ]

    def demand(self, name: str) -> None:
        """A demand as a router sends it."""

        async def send() -> None:
            client = aioredis.Redis(unix_socket_path=str(self.role.state_dir / "redis/redis.sock"))
            try:
                await desired.demand(client, name, "test")
            finally:
                await client.aclose()

        asyncio.run(send())

    def clean(self) -> None:
        for name in desired.read_all(self.client):
            self.ok("delete", "deployment", name, "--wait")


def _engines(root: Path, state: Path, env: dict[str, str]) -> None:
    fast = Behaviour(load_seconds=0.5, tokens_per_second=200)
    installs = {
        "vllm": install_python_engine(root / "e" / "vllm", "vllm", "0.29.0", fast),
        "sglang": install_python_engine(root / "e" / "sglang", "sglang", "0.5.16", fast),
        "slow": install_python_engine(
            root / "e" / "slow",
            "vllm",
            "0.29.0",
            Behaviour(load_seconds=0.5, tokens_per_second=8, answer=" ".join(["word"] * 80)),
        ),
        "leaky": install_python_engine(
            root / "e" / "leaky",
            "vllm",
            "0.29.0",
            Behaviour(load_seconds=0.5, faults=Faults(sleep_keeps_memory=True)),
        ),
        "crashy": install_python_engine(
            root / "e" / "crashy",
            "vllm",
            "0.29.0",
            Behaviour(load_seconds=0.5, faults=Faults(crash_at_start=CrashAtStart())),
        ),
        "slowload": install_python_engine(
            root / "e" / "slowload", "vllm", "0.29.0", Behaviour(load_seconds=60)
        ),
        "llama": install_llama_server(root / "e" / "llama", 6000, fast).parent,
    }
    for name, path in installs.items():
        target = path / "llama-server" if name == "llama" else path
        result = capyctl(
            "engine", "add", str(target), "--name", name, "--state-dir", str(state), env=env
        )
        assert result.returncode == 0, result.stderr


def _start(root: Path, gpus: str) -> Cluster:
    state = root / "state"
    env = clean_env(
        HOME=str(root), CAPYCTL_SIMULATED_GPUS=gpus, CAPYCTL_SIMULATED_HOST_RAM="256GiB"
    )
    _engines(root, state, env)
    for name, size in (("m14", 10 * GiB), ("small", 2 * GiB)):
        sparse_model(root / "models" / name, size)
    sparse_model(root / "models" / "gguf", 1 * GiB, gguf=True)
    document = root / "standalone.yaml"
    document.write_text(
        yaml.safe_dump(
            {
                "kind": "standalone",
                "server": {"scheduling": {"drain_timeout": 10, "park_verify_timeout": 3}},
            }
        )
    )
    role = start_role("standalone", state_dir=state, env=env, extra=["--config", str(document)])
    return Cluster(role, root)


@pytest.fixture(scope="module")
def one_gpu() -> Iterator[Cluster]:
    root = short_dir("sched")
    cluster = _start(root, "gpu0:24GiB")
    try:
        yield cluster
    finally:
        cluster.clean()  # engines outlive their role by design: stop them first
        cluster.role.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster(one_gpu: Cluster) -> Iterator[Cluster]:
    yield one_gpu
    one_gpu.clean()


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
    assert listing.splitlines()[0].split() == ["NAME", "STATE", "READY", "REVISION", "HOSTS"]
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
        cluster.ok("start", "deployment", name, "--wait")
        assert "parked" in cluster.ok("park", "deployment", name, "--wait")
        assert cluster.instance(name).residency == tier  # type: ignore[union-attr]
        assert "ready" in cluster.ok("start", "deployment", name, "--wait")
        reasons = [reason for _, to, reason in cluster.transitions(name) if to == "parked"]
        assert reasons
        assert f"parked ({tier})" in reasons[0]
    cluster.ok("start", "deployment", "ro", "--wait")
    refused = cluster.cli("park", "deployment", "ro")
    assert refused.returncode == 5
    assert "error [capability_missing:park]" in refused.stderr
    assert "stopped" in cluster.ok("stop", "deployment", "ro", "--wait")


def test_idle_models_park_then_stop(cluster: Cluster) -> None:
    cluster.deploy(
        "idle",
        model="small",
        lifecycle={"ready_idle_timeout": "2s", "parked_idle_timeout": "2s"},
        engine_config={"memory": {"request": "4GiB"}},
    )
    cluster.ok("start", "deployment", "idle", "--wait")
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
    cluster.ok("start", "deployment", "busy", "--wait")
    request = _slow_request(cluster, "busy", tokens=40)  # about 5 s at 8 tokens/s
    wait_for(lambda: cluster.status("busy")["state"] == "ready", timeout=5, what="ready")
    time.sleep(1.5)  # hostd's load reading shows the request
    cluster.ok("start", "deployment", "next")
    wait_for(
        lambda: any(
            "1 busy, warm or explicit kept" in d["reason"] for d in cluster.decisions("next")
        ),
        timeout=10,
        what="the switch to wait for the busy model",
    )
    assert cluster.state("busy") == "ready", "a model with requests in flight is no victim"
    request.join(timeout=30)
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
    cluster.ok("start", "deployment", "leaky", "--wait")
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
    too_big = cluster.cli("start", "deployment", "huge", "--wait", "--timeout", "2")
    assert too_big.returncode == 4, too_big.stderr
    assert "insufficient_resources: needs" in too_big.stderr
    assert "on gpu0" in too_big.stderr


def test_an_operator_stop_suspends_on_demand_activation(cluster: Cluster) -> None:
    cluster.deploy("op", model="small", engine_config={"memory": {"request": "4GiB"}})
    cluster.ok("start", "deployment", "op", "--wait")
    assert "stopped" in cluster.ok("stop", "deployment", "op", "--wait")
    cluster.demand("op")
    time.sleep(2)
    assert cluster.state("op") == "stopped", "a demand does not start an operator-stopped model"
    assert cluster.status("op")["state"] == "stopped"
    assert "ready" in cluster.ok("start", "deployment", "op", "--wait")


def test_drain_stops_every_engine_and_keeps_deployments_on_demand(cluster: Cluster) -> None:
    small = {"memory": {"request": "4GiB"}}
    cluster.deploy("d1", model="small", engine_config=small)
    cluster.deploy("d2", model="small", engine_config=small)
    cluster.ok("start", "deployment", "d1", "--wait")
    cluster.ok("start", "deployment", "d2", "--wait")
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
    cluster.ok("start", "deployment", "x", "--wait")
    cluster.ok("start", "deployment", "y")
    wait_for(
        lambda: cluster.state("x") in ("draining", "parking"),
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
    assert gpu0["charged"] == GiB + 14 * GiB, "x parked (1 GiB) and y ready (14 GiB), once each"
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
                "engine": "vllm",
                "model": "small",
                "devices": [{"id": "gpu0"}, {"id": "gpu1"}],
            },
            5,
            "multi_gpu_unsupported",
        ),
        (
            {"name": "u", "engine": "vllm", "model": {"hf": "Qwen/Qwen3-4B"}},
            5,
            "model_source_pending",
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
        assert "u" not in desired.read_all(cluster.client), "nothing declared"
    assert list(desired.read_all(cluster.client)) == ["taken"], "what was declared stays"


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


def test_placement_across_two_gpus() -> None:
    root = short_dir("sched2")
    cluster = _start(root, "gpu0:24GiB,gpu1:24GiB")
    try:
        cluster.deploy("p", engine_config=FOURTEEN)
        cluster.deploy("q", engine_config=FOURTEEN)
        cluster.deploy("r", engine_config=FOURTEEN, devices=[{"id": "gpu1"}])
        cluster.ok("start", "deployment", "p", "--wait")
        cluster.ok("start", "deployment", "q", "--wait")
        gpus = {n: cluster.status(n)["instances"][0]["gpu"] for n in "pq"}
        assert sorted(gpus.values()) == ["gpu0", "gpu1"], "the one with most headroom"
        cluster.ok("start", "deployment", "r", "--wait")
        assert cluster.status("r")["instances"][0]["gpu"] == "gpu1", "pinned"
        displaced = next(n for n in "pq" if gpus[n] == "gpu1")
        assert cluster.state(displaced) == "parked", "the switch happened on r's GPU"
        kept = next(n for n in "pq" if gpus[n] == "gpu0")
        assert cluster.state(kept) == "ready"
    finally:
        cluster.clean()  # engines outlive their role by design: stop them first
        cluster.role.stop()
        shutil.rmtree(root, ignore_errors=True)
