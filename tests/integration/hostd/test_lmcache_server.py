"""An instance's private LMCache server as hostd runs it, with the simulator as vLLM 0.32.0
and SGLang 0.5.22 and the project's LMCache stand-in (a real process each): started and
healthy before the engine, on leased loopback ports, the engine wired to it and registered
before the instance is ready; stopped after the engine; kept through a restart_only park and
connected to again; started anew after an engine crash; found again after a restart of
hostd."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from capycommon.domain.commands import CacheLaunch, Stop
from capycommon.domain.instances import CacheRecord, InstanceRecord
from capycommon.engines import detect, lmcache, registry
from capycommon.engines.registry import EngineProfile
from enginesim.behaviour import LMCacheBehaviour
from enginesim.install import install_lmcache, install_python_engine, write_behaviour
from integration.hostd.harness import FAST, GiB, Hostd, environ, launch
from support import group_members, short_dir, wait_for

POOL = 2 * GiB
CACHE = CacheLaunch(profile="lmcache", pool_bytes=POOL, host_bytes=POOL + GiB, device_bytes=GiB)
# The same in SGLang's environment: each engine loads LMCache's connector from its own.
CACHE_SG = CACHE.model_copy(update={"profile": "lmcache-sg"})
# A prompt longer than two chunks of 256 tokens, however the simulator counts its tokens.
LONG = " ".join(f"word{i}" for i in range(1200))


@pytest.fixture(scope="module")
def cached_installs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """vLLM 0.32.0 and SGLang 0.5.22, each with LMCache 0.5.6 in its environment."""
    root = tmp_path_factory.mktemp("lmcache-engines")
    vllm = install_python_engine(root / "vllm32", "vllm", "0.32.0", FAST)
    sglang = install_python_engine(root / "sglang22", "sglang", "0.5.22", FAST)
    return {"vllm32": install_lmcache(vllm, "0.5.6"), "sglang22": install_lmcache(sglang, "0.5.6")}


# The name each installation is registered under, by family.
NAMES = {
    "vllm32": {"vllm": "vllm32", "lmcache": "lmcache"},
    "sglang22": {"sglang": "sglang22", "lmcache": "lmcache-sg"},
}


@pytest.fixture
def hostd(redis_socket: Path, cached_installs: dict[str, Path], model: Path) -> Iterator[Setup]:
    """hostd with vLLM 0.32.0, SGLang 0.5.22 and LMCache 0.5.6 registered; every engine and
    server it left is killed afterwards."""
    for name, install in cached_installs.items():
        write_behaviour(install, FAST)
        # vLLM's beside the HTTP API LMCache 0.5.6 serves (no /api/ routes), SGLang's beside
        # the newer one: hostd finds the health and status paths of either.
        write_behaviour(install, LMCacheBehaviour(api_routes=name != "vllm32"))
    root = short_dir("hostd-lmc")
    harness = Hostd(state=root / "state", home=root / "home", redis_socket=redis_socket)
    harness.state.mkdir(mode=0o700, parents=True)
    gpu = harness.prepare({})
    file = registry.locate(None, harness.home)
    for name, install in cached_installs.items():
        for found in detect.probe(install):
            registry.add(file, found.profile(NAMES[name][found.family]))
    harness.start()
    yield Setup(harness, gpu, model)
    harness.stop()
    for name in ("a", "b"):
        record = harness.record(name)
        processes = [] if record is None else [record.process]
        if record is not None and record.cache is not None:
            processes.append(record.cache.process)
        for process in processes:
            if process is not None and group_members(process.pgid):
                os.killpg(process.pgid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True)
class Setup:
    harness: Hostd
    gpu: str
    model: Path


def ready(setup: Setup, name: str = "a", generation: int = 1, **changes: object) -> InstanceRecord:
    fields: dict[str, object] = {
        "profile": "vllm32",
        "residency": "restart_only",
        "cache": CACHE,
        **changes,
    }
    setup.harness.send(launch(name, generation, setup.gpu, setup.model, **fields))
    found = setup.harness.wait_state(name, "ready")
    assert found.generation == generation
    return found


def cache_of(record: InstanceRecord) -> CacheRecord:
    assert record.cache is not None
    return record.cache


@pytest.fixture
def record(hostd: Setup) -> InstanceRecord:
    """Instance `a`, generation 1, ready with its LMCache server."""
    return ready(hostd)


def status(cache: CacheRecord) -> dict[str, object]:
    answer = httpx.get(f"http://127.0.0.1:{cache.http_port}/status", timeout=5)
    answer.raise_for_status()
    result: dict[str, object] = answer.json()
    return result


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def log_lines(record: InstanceRecord) -> list[str]:
    assert record.log_path is not None
    return Path(record.log_path).read_text().splitlines()


def first_line(lines: list[str], text: str) -> int:
    """The index of the first of `lines` that holds `text`."""
    return next(i for i, line in enumerate(lines) if text in line)


def engine_group(record: InstanceRecord) -> list[int]:
    """The live processes of the engine's process group."""
    assert record.process is not None
    return group_members(record.process.pgid)


def stop(
    harness: Hostd, reason: str, name: str = "a", generation: int = 1, keep_cache: bool = False
) -> InstanceRecord:
    """Stop instance `generation` of `name` and wait until hostd records it stopped."""
    harness.send(Stop(deployment=name, generation=generation, reason=reason, keep_cache=keep_cache))
    return harness.wait_state(name, "stopped")


def ask(harness: Hostd, record: InstanceRecord, content: str) -> int:
    """One chat completion straight to the engine; the prompt tokens it found cached."""
    answer = httpx.post(
        f"http://127.0.0.1:{record.port}/v1/chat/completions",
        headers={"Authorization": f"Bearer {harness.secret(record.deployment)}"},
        json={
            "model": record.deployment,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
        },
        timeout=30,
    )
    answer.raise_for_status()
    details = answer.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def test_the_server_starts_healthy_before_the_engine_which_registers_before_ready(
    hostd: Setup, record: InstanceRecord
) -> None:
    harness, gpu, cache = hostd.harness, hostd.gpu, cache_of(record)
    assert record.process is not None
    assert cache.process.start_ticks <= record.process.start_ticks, "the server first"
    assert cache.pool_bytes == POOL
    assert (cache.host_bytes, cache.device_bytes) == (CACHE.host_bytes, CACHE.device_bytes)
    assert status(cache)["registered_gpu_ids"], "the engine registered before ready"
    argv = cmdline(cache.process.pid)
    assert argv[1:3] == ["-m", "lmcache.v1.multiprocess.http_server"]
    ports = lmcache.ServerPorts(cache.zmq_port, cache.http_port, cache.metrics_port)
    assert argv[3:] == lmcache.server_argv(cache_profile(harness), ports, POOL)[3:]
    seed = lmcache.hash_seed("a", 1)
    server_env = environ(cache.process.pid)
    assert server_env["DO_NOT_TRACK"] == "1"
    assert server_env["LMCACHE_TRACK_USAGE"] == "false"
    assert server_env["PYTHONHASHSEED"] == seed
    assert server_env["CUDA_VISIBLE_DEVICES"] == gpu
    engine_env = environ(record.process.pid)
    assert engine_env["PYTHONHASHSEED"] == seed, "the engine's chunk keys match the server's"
    engine_argv = cmdline(record.process.pid)
    wiring = json.loads(engine_argv[engine_argv.index("--kv-transfer-config") + 1])
    assert wiring["kv_connector"] == "LMCacheMPConnector"
    assert wiring["kv_connector_extra_config"]["lmcache.mp.port"] == cache.zmq_port
    lines = log_lines(record)
    running = first_line(lines, "cache server is running")
    registered = first_line(lines, "Registered a vllm worker")
    assert running < registered, "one log for both, the server's lines first"


def cache_profile(harness: Hostd) -> EngineProfile:
    profiles = registry.read(registry.locate(None, harness.home)).document.profiles
    return profiles["lmcache"]


def test_a_stop_stops_the_engine_then_the_server_and_gives_its_ports_back(
    hostd: Setup, record: InstanceRecord
) -> None:
    harness, cache = hostd.harness, cache_of(record)
    assert stop(harness, "test").cache is None
    assert group_members(cache.process.pgid) == []
    assert engine_group(record) == []
    lines = log_lines(record)
    gone = first_line(lines, "Unregistered the vllm worker")
    ended = first_line(lines, "LMCache server stopped")
    assert gone < ended, "the engine's connection closed before the server stopped"
    again = ready(hostd, generation=2)
    assert record.port is not None
    assert again.port is not None
    before = {record.port, *ports_of(cache)}
    taken = {again.port, *ports_of(cache_of(again))}
    # hostd leases the lowest free ports with a plain bind, which a port whose closed
    # connections linger (TIME_WAIT) refuses for a while: such a port is skipped, never held.
    assert all(port in taken or nothing_listens(port) for port in before), (before, taken)
    assert len(taken - before) <= len(before - taken), "no port beyond those given back"


def ports_of(cache: CacheRecord) -> tuple[int, int, int]:
    return cache.zmq_port, cache.http_port, cache.metrics_port


def nothing_listens(port: int) -> bool:
    """No socket holds the port but lingering closed connections: a bind that allows them
    takes it."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_restart_only_park_keeps_the_server_and_the_next_start_hits_its_cache(
    hostd: Setup, record: InstanceRecord
) -> None:
    harness, cache = hostd.harness, cache_of(record)
    assert ask(harness, record, LONG) == 0
    assert ask(harness, record, LONG) > 0, "the same prompt again comes from the cache"
    parked = stop(harness, "idle", keep_cache=True)
    assert parked.cache == cache, "kept, and still charged"
    assert group_members(cache.process.pgid), "the server runs on"
    assert engine_group(record) == []
    again = ready(hostd, generation=2)
    assert cache_of(again).process == cache.process, "the kept server, connected to again"
    assert status(cache)["registered_gpu_ids"]
    assert ask(harness, again, LONG) > 0, "answered from the cache across the park"
    assert stop(harness, "operator stop", generation=2).cache is None
    assert group_members(cache.process.pgid) == []


def test_a_kept_server_is_stopped_by_a_stop_of_its_stopped_instance(
    hostd: Setup,
) -> None:
    harness = hostd.harness
    cache = cache_of(ready(hostd))
    stop(harness, "idle", keep_cache=True)
    harness.send(Stop(deployment="a", generation=1, reason="parked idle"))
    wait_for(
        lambda: (found := harness.record("a")) is not None and found.cache is None,
        timeout=30,
        what="the kept server's release",
    )
    assert group_members(cache.process.pgid) == []


def test_a_kept_server_of_another_revision_is_replaced(hostd: Setup) -> None:
    harness = hostd.harness
    cache = cache_of(ready(hostd))
    stop(harness, "idle", keep_cache=True)
    again = ready(hostd, generation=2, revision=2)
    assert cache_of(again).process != cache.process
    assert group_members(cache.process.pgid) == []
    assert environ(cache_of(again).process.pid)["PYTHONHASHSEED"] == lmcache.hash_seed("a", 2)


def test_an_engine_crash_stops_its_server_and_the_relaunch_starts_a_new_one(
    hostd: Setup, record: InstanceRecord
) -> None:
    harness, cache = hostd.harness, cache_of(record)
    assert record.process is not None
    os.killpg(record.process.pgid, signal.SIGKILL)
    failed = harness.wait_state("a", "failed")
    assert failed.cache is None
    assert group_members(cache.process.pgid) == [], "stopped before any relaunch"
    again = ready(hostd, generation=2)
    assert cache_of(again).process != cache.process


def test_a_server_that_dies_fails_its_instance(hostd: Setup, record: InstanceRecord) -> None:
    harness = hostd.harness
    os.killpg(cache_of(record).process.pgid, signal.SIGKILL)
    failed = harness.wait_state("a", "failed")
    assert "its LMCache server exited on its own" in (failed.error or "")
    assert engine_group(record) == []


def test_a_server_that_fails_at_start_fails_the_launch_before_any_engine(
    hostd: Setup, cached_installs: dict[str, Path]
) -> None:
    harness, gpu = hostd.harness, hostd.gpu
    write_behaviour(
        cached_installs["vllm32"], LMCacheBehaviour(api_routes=False, fail_at_start=True)
    )
    harness.send(launch("a", 1, gpu, hostd.model, profile="vllm32", cache=CACHE))
    failed = harness.wait_state("a", "failed")
    assert "LMCache server" in (failed.error or "")
    assert failed.process is None, "no engine was started"


def test_several_instances_lease_ports_of_their_own(hostd: Setup) -> None:
    first = ready(hostd, "a")
    second = ready(hostd, "b", profile="sglang22", cache=CACHE_SG)
    taken = [first.port, second.port, *ports_of(cache_of(first)), *ports_of(cache_of(second))]
    assert len(set(taken)) == 8, taken
    assert status(cache_of(second))["registered_gpu_ids"], "SGLang registered through its file"
    assert second.process is not None
    argv = cmdline(second.process.pid)
    assert "--enable-lmcache" in argv
    config = Path(argv[argv.index("--lmcache-config-file") + 1]).read_text()
    assert f"mp_port: {cache_of(second).zmq_port}" in config


def test_a_restart_of_hostd_finds_the_servers_again(hostd: Setup) -> None:
    harness = hostd.harness
    live = ready(hostd, "a")
    kept = cache_of(ready(hostd, "b"))
    stop(harness, "idle", "b", keep_cache=True)
    harness.kill9()
    harness.start()
    wait_for(
        lambda: (found := harness.record("a")) is not None and found.state == "ready",
        timeout=30,
        what="a re-adopted",
    )
    assert harness.record("a") == live, "re-adopted as it was"
    assert group_members(kept.process.pgid), "the kept server runs on"
    again = ready(hostd, "b", generation=2)
    assert cache_of(again).process == kept.process, "found again, and connected to"
    assert stop(harness, "test").cache is None
    assert group_members(cache_of(live).process.pgid) == []
