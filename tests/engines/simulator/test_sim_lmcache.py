"""The stand-in LMCache server, its install, and the simulated engines' LMCache connectors."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from capycommon import simgpu
from capycommon.engines.detect import probe_venv
from capycommon.engines.families import Family
from engines.simulator.helpers import (
    FAST,
    Engine,
    Installs,
    Launcher,
    SimGpu,
    closed_env,
    env_for,
    parse_metric,
    python_argv,
    recorded,
    sha256,
    site_packages,
    with_group_killed,
)
from enginesim import (
    Behaviour,
    LMCacheBehaviour,
    install_lmcache,
    install_python_engine,
    write_behaviour,
)
from enginesim.behaviour import load_lmcache_behaviour
from enginesim.install import behaviour_path, lmcache_behaviour_path
from support import wait_for

LMCACHE = "0.5.6"
VLLM = "0.32.0"
SGLANG = "0.5.22"
SERVER_MODULE = "lmcache.v1.multiprocess.http_server"
LOOPBACK = "127.0.0.1"
SEED = "31337"
QUICK = LMCacheBehaviour(startup_seconds=0.3)
# 2115 characters: 529 tokens, two full chunks of 256 (512 tokens) and a partial one.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 47
CHUNKS = 512
PROBE = "import importlib.metadata as m; print(m.version('{name}'))"
UNHEALTHY = {"status": "unhealthy", "reason": "engine not initialized"}


@dataclass(frozen=True)
class Server:
    """A launched LMCache server: its HTTP API is `proc`'s port."""

    proc: Engine
    zmq: int
    prometheus: int

    def status(self) -> dict[str, Any]:
        found: dict[str, Any] = self.proc.get("/api/status").json()
        return found

    def registered(self) -> list[int]:
        ids: list[int] = self.status()["registered_gpu_ids"]
        return ids


def version_of(venv: Path, name: str) -> str:
    """The installed version of `name`, read as CapyCTL's probe reads it."""
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c", PROBE.format(name=name)],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return probe.stdout.strip()


def kv_config(port: int, **extra: Any) -> str:
    """vLLM's `--kv-transfer-config` for LMCache's MP connector (`extra` overrides keys)."""
    config: dict[str, Any] = {
        "kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": f"tcp://{LOOPBACK}",
            "lmcache.mp.port": port,
            "lmcache.mp.autostart": False,
        },
    }
    return json.dumps({**config, **extra})


def seeded(seed: str | None) -> dict[str, str]:
    return {"PYTHONHASHSEED": seed} if seed is not None else {}


def cached(engine: Engine, salt: str | None = None, prompt: str = PROMPT) -> int:
    """Send `prompt` through the openai SDK; the tokens the engine found in the cache."""
    extra = {"cache_salt": salt} if salt is not None else None
    answer = engine.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], extra_body=extra
    )
    assert answer.usage is not None
    assert answer.usage.prompt_tokens_details is not None
    tokens = answer.usage.prompt_tokens_details.cached_tokens
    assert tokens is not None
    return tokens


@dataclass(frozen=True)
class Setup:
    """Starts LMCache servers and engines with LMCache for one test."""

    launcher: Launcher
    home: Path
    model: Path
    gpu: SimGpu
    lmcache: Path  # a venv holding only lmcache
    vllm: Path  # vLLM with lmcache in the same venv
    sglang: Path  # SGLang with lmcache in the same venv

    def server_argv(self, *extra: str, ports: tuple[int, int] | None = None) -> list[str]:
        """The server as CapyCTL launches it, `python -I -m ...`, on the ZMQ and Prometheus
        `ports` (by default, two held for it); its HTTP port is `{port}`."""
        zmq, prometheus = ports or self.launcher.reserve(2)
        return [
            str(self.lmcache / "bin" / "python"),
            "-I",
            "-m",
            SERVER_MODULE,
            "--host",
            LOOPBACK,
            "--port",
            str(zmq),
            "--http-host",
            LOOPBACK,
            "--http-port",
            "{port}",
            "--prometheus-port",
            str(prometheus),
            "--l1-size-gb",
            "1",
            "--eviction-policy",
            "LRU",
            *extra,
        ]

    def server(
        self,
        behaviour: LMCacheBehaviour = QUICK,
        *extra: str,
        seed: str | None = SEED,
        ports_of: Server | None = None,
    ) -> Server:
        """A server, started (it may still be initialising), on new ports or on those of
        `ports_of` (held for the test until its end, so no one took them meanwhile)."""
        write_behaviour(self.lmcache, behaviour)
        zmq, prometheus = (
            (ports_of.zmq, ports_of.prometheus) if ports_of else self.launcher.reserve(2)
        )
        http = ports_of.proc.port if ports_of else None
        argv = self.server_argv(*extra, ports=(zmq, prometheus))
        env = closed_env(None, self.home, **seeded(seed))
        return Server(self.launcher.start(argv, env, port=http), zmq, prometheus)

    def serving(self, behaviour: LMCacheBehaviour = QUICK, *extra: str) -> Server:
        server = self.server(behaviour, *extra)
        server.proc.wait_status(200, "/api/healthcheck")
        return server

    def vllm_engine(
        self,
        *extra: str,
        seed: str | None = SEED,
        behaviour: Behaviour = FAST,
        venv: Path | None = None,
        **env: str,
    ) -> Engine:
        venv = venv or self.vllm
        write_behaviour(venv, behaviour)
        argv = python_argv("vllm", venv, self.model, "--host", LOOPBACK)
        argv += ["--served-model-name", "tiny", *extra]
        return self.launcher.start(argv, env_for(venv, self.home, self.gpu, **seeded(seed), **env))

    def sglang_engine(self, *extra: str, **env: str) -> Engine:
        write_behaviour(self.sglang, FAST)
        argv = python_argv("sglang", self.sglang, self.model, "--served-model-name", "tiny")
        env = {**seeded(SEED), **env}
        return self.launcher.start(
            argv + list(extra), env_for(self.sglang, self.home, self.gpu, **env)
        )

    def sglang_config(self, server: Server) -> Path:
        path = self.home / f"lmcache-{server.zmq}.yaml"
        path.write_text(f"mp_host: {LOOPBACK}\nmp_port: {server.zmq}\n")
        return path


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(lmcache alone, vLLM with lmcache, SGLang with lmcache), made once for the module."""
    folder = tmp_path_factory.mktemp("lmcache-installs")
    alone = install_lmcache(folder / "lmcache", LMCACHE, QUICK)
    vllm = install_lmcache(install_python_engine(folder / "vllm", "vllm", VLLM, FAST))
    sglang = install_lmcache(install_python_engine(folder / "sglang", "sglang", SGLANG, FAST))
    return alone, vllm, sglang


@pytest.fixture
def two_gpus(tmp_path: Path) -> SimGpu:
    """Two simulated devices; the engine sees the second (index 1)."""
    devices = simgpu.parse_devices("gpu0:24GiB,gpu1:24GiB")
    simgpu.write_devices(tmp_path / "simgpu", devices)
    return SimGpu(tmp_path / "simgpu", devices[1].uuid, devices[1].total_bytes)


@pytest.fixture
def setup(
    venvs: tuple[Path, Path, Path],
    launcher: Launcher,
    tmp_path: Path,
    model_dir: Path,
    two_gpus: SimGpu,
) -> Setup:
    alone, vllm, sglang = venvs
    return Setup(launcher, tmp_path, model_dir, two_gpus, alone, vllm, sglang)


class Line:
    """A raw client of the server's line protocol."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection((LOOPBACK, port), timeout=10)
        self.lines = self.sock.makefile("rb")

    def ask(self, message: dict[str, Any] | str) -> dict[str, Any]:
        text = message if isinstance(message, str) else json.dumps(message)
        self.sock.sendall(text.encode() + b"\n")
        answer: dict[str, Any] = json.loads(self.lines.readline())
        return answer

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


@pytest.fixture
def lines() -> Iterator[list[Line]]:
    """Raw clients, closed after the test."""
    made: list[Line] = []
    yield made
    for line in made:
        line.close()


# The stand-in server ----------------------------------------------------------------------


def test_health_is_503_while_initialising_then_200_on_both_paths(setup: Setup) -> None:
    server = setup.server(LMCacheBehaviour(startup_seconds=2))
    api = server.proc
    first = wait_for(lambda: api.status("/api/healthcheck"), 20, "the HTTP API to answer")
    assert first == 503
    assert api.get("/api/healthcheck").json() == UNHEALTHY
    assert api.get("/healthcheck").json() == UNHEALTHY
    assert api.get("/").json() == {"status": "ok", "service": "LMCache HTTP API"}
    api.wait_status(200, "/api/healthcheck")
    assert api.get("/api/healthcheck").json() == {"status": "healthy"}
    assert api.get("/healthcheck").json() == {"status": "healthy"}
    assert "LMCache INFO: LMCache cache server is running..." in api.output()
    assert "PYTHONHASHSEED" not in api.output()
    cmdline = Path(f"/proc/{api.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert [b"-m", SERVER_MODULE.encode()] == cmdline[2:4]


def test_the_line_protocol_registers_while_connected(setup: Setup, lines: list[Line]) -> None:
    server = setup.serving(QUICK, "--chunk-size", "64")
    assert server.status() == {
        "chunk_size": 64,
        "hash_algorithm": "blake3",
        "registered_gpu_ids": [],
        "active_sessions": 0,
        "storage_manager": {"l1_size_gb": 1.0, "eviction_policy": "LRU", "stored_chunks": 0},
        "gpu_context_meta": {},
    }
    client = Line(server.zmq)
    lines.append(client)
    assert client.ask({"op": "register", "gpu_ids": [3, 1], "engine": "vllm"}) == {"ok": True}
    assert client.ask({"op": "config"}) == {"chunk_size": 64, "hash_algorithm": "blake3"}
    assert client.ask({"op": "lookup", "key": "aa", "tokens": 64}) == {"hit": False, "tokens": 0}
    assert client.ask({"op": "store", "key": "aa", "tokens": 64}) == {"ok": True}
    assert client.ask({"op": "lookup", "key": "aa", "tokens": 64}) == {"hit": True, "tokens": 64}
    assert "error" in client.ask("not json")
    assert "error" in client.ask({"op": "evict"})
    assert "error" in client.ask({"op": "register", "gpu_ids": "0"})
    status = server.status()
    assert (status["registered_gpu_ids"], status["active_sessions"]) == ([1, 3], 1)
    assert status["storage_manager"]["stored_chunks"] == 1
    client.close()
    wait_for(lambda: server.registered() == [], 10, "the registration to end with its connection")
    output = server.proc.output()
    assert "LMCache INFO: Stored 64 tokens" in output
    assert "LMCache INFO: Retrieved 64 tokens" in output
    assert "Unregistered the vllm worker" in output


def test_metrics_on_both_ports_and_clear_cache(setup: Setup, lines: list[Line]) -> None:
    server = setup.serving()
    client = Line(server.zmq)
    lines.append(client)
    client.ask({"op": "store", "key": "bb", "tokens": 256})
    client.ask({"op": "lookup", "key": "bb", "tokens": 256})
    client.ask({"op": "lookup", "key": "bb", "tokens": 256})
    prometheus = httpx.get(f"http://{LOOPBACK}:{server.prometheus}/metrics", timeout=10)
    for text in (prometheus.text, server.proc.get("/metrics").text):
        assert parse_metric(text, "lmcache_mp_stored_tokens_total") == 256
        assert parse_metric(text, "lmcache_mp_retrieved_tokens_total") == 512
    assert prometheus.headers["content-type"].startswith("text/plain")
    assert httpx.get(f"http://{LOOPBACK}:{server.prometheus}/", timeout=10).status_code == 404
    cleared = server.proc.post("/api/clear-cache")
    assert (cleared.status_code, cleared.json()) == (200, {"status": "ok"})
    assert server.status()["storage_manager"]["stored_chunks"] == 0
    assert client.ask({"op": "lookup", "key": "bb", "tokens": 256})["hit"] is False


def test_argv_is_refused_as_argparse_refuses_it(setup: Setup) -> None:
    base = setup.server_argv()
    env = closed_env(None, setup.home)
    without_pool = [a for a in base if a not in ("--l1-size-gb", "1")]
    cases = {
        "the following arguments are required: --l1-size-gb": without_pool,
        "unrecognized arguments: --frobnicate": [*base, "--frobnicate"],
        "argument --eviction-policy: invalid choice: 'FIFO'": [*base, "--eviction-policy", "FIFO"],
    }
    for message, argv in cases.items():
        done = setup.launcher.run([part.replace("{port}", "1") for part in argv], env)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("usage: http_server.py"), done.stderr
        assert message in done.stderr


def test_a_taken_port_is_an_exit_naming_it(setup: Setup) -> None:
    write_behaviour(setup.lmcache, QUICK)
    with socket.socket() as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = [part.replace("{port}", str(port)) for part in setup.server_argv()]
        done = setup.launcher.run(argv, closed_env(None, setup.home, PYTHONHASHSEED=SEED))
    assert done.returncode == 1
    assert f"cannot bind the HTTP port {LOOPBACK}:{port}" in done.stderr


def test_fail_at_start_exits_before_binding(setup: Setup) -> None:
    write_behaviour(setup.lmcache, LMCacheBehaviour(fail_at_start=True, fail_message="boom"))
    argv = [part.replace("{port}", "1") for part in setup.server_argv()]
    done = setup.launcher.run(argv, closed_env(None, setup.home))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "boom"
    assert "Engines connect to" not in done.stdout


def test_without_a_seed_it_warns_and_disable_metrics_binds_no_port(setup: Setup) -> None:
    server = setup.server(QUICK, "--disable-metrics", seed=None)
    server.proc.wait_status(200, "/api/healthcheck")
    assert "LMCache WARNING: PYTHONHASHSEED is not set" in server.proc.output()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://{LOOPBACK}:{server.prometheus}/metrics", timeout=5)


def test_resident_memory_and_a_crash_after_start(setup: Setup) -> None:
    behaviour = LMCacheBehaviour(startup_seconds=0.1, resident_mib=160, crash_after_seconds=1.5)
    server = setup.server(behaviour)
    server.proc.wait_status(200, "/api/healthcheck")
    status = Path(f"/proc/{server.proc.proc.pid}/status").read_text()
    rss_kib = int(
        next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1]
    )
    assert rss_kib >= 160 * 1024
    assert server.proc.wait_exit() == 1
    assert "RuntimeError: simulated LMCache server crash" in server.proc.output()


# The install --------------------------------------------------------------------------------


def test_install_lmcache_is_a_real_distribution(setup: Setup) -> None:
    venv = setup.lmcache
    assert version_of(venv, "lmcache") == LMCACHE
    found = probe_venv(venv)
    assert [(f.family, f.version) for f in found] == [(Family.LMCACHE, LMCACHE)]
    files = recorded(venv, "lmcache", LMCACHE)
    paths = {path for path, _ in files}
    assert venv / "bin" / "lmcache" in paths
    assert site_packages(venv) / "lmcache/v1/multiprocess/http_server.py" in paths
    assert all(sha256(path) == digest for path, digest in files)
    assert lmcache_behaviour_path(venv) == site_packages(venv) / "lmcache/_capyctl_sim.json"
    assert lmcache_behaviour_path(venv) not in paths
    slow = LMCacheBehaviour(startup_seconds=9, resident_mib=1)
    write_behaviour(venv, slow)
    assert load_lmcache_behaviour(lmcache_behaviour_path(venv)) == slow
    assert recorded(venv, "lmcache", LMCACHE) == files
    assert all(sha256(path) == digest for path, digest in files)
    assert probe_venv(venv) == found  # the same fingerprint


def test_install_into_an_engine_venv_leaves_the_engine_alone(tmp_path: Path) -> None:
    venv = install_python_engine(tmp_path / "vllm", "vllm", VLLM, FAST)
    (engine,) = probe_venv(venv)
    install_lmcache(venv, "0.5.7", QUICK)
    assert (version_of(venv, "vllm"), version_of(venv, "lmcache")) == (VLLM, "0.5.7")
    after = {found.family: found for found in probe_venv(venv)}
    assert after[Family.VLLM] == engine
    assert after[Family.LMCACHE].version == "0.5.7"
    assert behaviour_path(venv) != lmcache_behaviour_path(venv)
    assert load_lmcache_behaviour(lmcache_behaviour_path(venv)) == QUICK


def test_the_lmcache_command_runs_the_server(setup: Setup) -> None:
    write_behaviour(setup.lmcache, QUICK)
    argv = setup.server_argv()
    command = [str(setup.lmcache / "bin" / "lmcache"), "server", *argv[4:]]
    server = setup.launcher.start(command, closed_env(None, setup.home, PYTHONHASHSEED=SEED))
    server.wait_status(200, "/api/healthcheck")
    bare = setup.launcher.run([command[0]], closed_env(None, setup.home))
    assert bare.returncode == 2
    assert "the following arguments are required: command" in bare.stderr


# vLLM ---------------------------------------------------------------------------------------


def test_vllm_registers_its_gpu_and_unregisters_when_killed(setup: Setup) -> None:
    server = setup.serving()
    engine = setup.vllm_engine("--kv-transfer-config", kv_config(server.zmq))
    engine.wait_status(200)
    assert server.registered() == [1]
    assert server.status()["active_sessions"] == 1
    assert "Using LMCacheMPConnector from lmcache.integration.vllm" in engine.output()
    with_group_killed(engine.proc.pid)
    wait_for(lambda: server.registered() == [], 10, "the killed engine to unregister")
    assert server.status()["active_sessions"] == 0


def test_vllm_the_same_prompt_twice_hits(setup: Setup) -> None:
    server = setup.serving()
    engine = setup.vllm_engine("--kv-transfer-config", kv_config(server.zmq))
    engine.wait_status(200)
    assert cached(engine) == 0
    assert cached(engine) == CHUNKS
    streamed = engine.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details is not None
    assert usage[-1].prompt_tokens_details.cached_tokens == CHUNKS
    assert cached(engine, prompt="short") == 0
    output = server.proc.output()
    assert output.count("LMCache INFO: Stored 256 tokens") == 2
    assert output.count("LMCache INFO: Retrieved 256 tokens") == 4
    assert parse_metric(server.proc.get("/metrics").text, "lmcache_mp_retrieved_tokens_total") == (
        2 * CHUNKS
    )


def test_vllm_answers_go_out_once_their_misses_are_stored(setup: Setup) -> None:
    """Even an instant engine's answer, whole at admission, waits for a slow store, streamed
    or not: what an engine killed right after answering stored, its successor finds."""
    server = setup.serving(LMCacheBehaviour(startup_seconds=0.3, store_seconds=0.4))
    instant = FAST.model_copy(update={"instant": True})
    config = ("--kv-transfer-config", kv_config(server.zmq))
    first = setup.vllm_engine(*config, behaviour=instant)
    first.wait_status(200)
    assert cached(first) == 0
    with_group_killed(first.proc.pid)
    second = setup.vllm_engine(*config, behaviour=instant)
    second.wait_status(200)
    assert cached(second) == CHUNKS
    streamed = second.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        stream=True,
        extra_body={"cache_salt": "streamed"},
    )
    assert list(streamed)
    with_group_killed(second.proc.pid)
    third = setup.vllm_engine(*config, behaviour=instant)
    third.wait_status(200)
    assert cached(third, salt="streamed") == CHUNKS


def test_vllm_hits_after_a_restart_only_with_the_same_seed(setup: Setup) -> None:
    server = setup.serving()
    config = ("--kv-transfer-config", kv_config(server.zmq))
    first = setup.vllm_engine(*config)
    first.wait_status(200)
    assert cached(first) == 0
    assert first.stop() == 0
    wait_for(lambda: server.registered() == [], 10, "the stopped engine to unregister")
    again = setup.vllm_engine(*config)
    again.wait_status(200)
    assert cached(again) == CHUNKS
    assert again.stop() == 0
    unseeded = setup.vllm_engine(*config, seed=None)
    unseeded.wait_status(200)
    assert cached(unseeded) == 0


def test_vllm_different_salts_never_share(setup: Setup) -> None:
    server = setup.serving()
    engine = setup.vllm_engine("--kv-transfer-config", kv_config(server.zmq))
    engine.wait_status(200)
    assert cached(engine, salt="tenant-a") == 0
    assert cached(engine, salt="tenant-b") == 0
    assert cached(engine, salt="tenant-a") == CHUNKS
    assert cached(engine) == 0


def test_vllm_runs_uncached_while_its_server_is_gone_then_registers_again(
    setup: Setup,
) -> None:
    server = setup.serving()
    engine = setup.vllm_engine("--kv-transfer-config", kv_config(server.zmq))
    engine.wait_status(200)
    assert cached(engine) == 0
    with_group_killed(server.proc.proc.pid)
    assert cached(engine) == 0
    assert "requests run uncached until it is back" in engine.output()
    again = setup.server(ports_of=server)
    again.proc.wait_status(200, "/api/healthcheck")
    assert cached(engine) == 0  # a new server holds nothing
    assert again.registered() == [1]
    assert cached(engine) == CHUNKS


def test_vllm_exits_when_its_server_cannot_be_reached(setup: Setup) -> None:
    (port,) = setup.launcher.reserve(1)  # held, and nothing listens on it
    behaviour = FAST.model_copy(update={"kv_connect_seconds": 1.0})
    extra = {"lmcache.mp.host": LOOPBACK, "lmcache.mp.port": port}  # a bare address
    engine = setup.vllm_engine(
        "--kv-transfer-config",
        kv_config(port, kv_connector_extra_config=extra),
        behaviour=behaviour,
    )
    assert engine.wait_exit() != 0
    message = f"ConnectionError: cannot reach the LMCache server at tcp://{LOOPBACK}:{port}"
    assert message in engine.output()


def test_vllm_waits_for_a_server_that_never_initialises_then_exits(setup: Setup) -> None:
    server = setup.server(LMCacheBehaviour(never_healthy=True))
    wait_for(lambda: server.proc.status("/api/healthcheck") == 503, 20, "the server to answer")
    behaviour = FAST.model_copy(update={"kv_connect_seconds": 1.0})
    engine = setup.vllm_engine("--kv-transfer-config", kv_config(server.zmq), behaviour=behaviour)
    assert engine.wait_exit() != 0
    assert "ConnectionError: cannot reach the LMCache server" in engine.output()


def test_vllm_refuses_what_it_cannot_run(setup: Setup, installs: Installs) -> None:
    python = str(setup.vllm / "bin" / "python")
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(setup.model)]
    env = env_for(setup.vllm, setup.home, setup.gpu)
    for config, message in (
        ("{not json", "argument --kv-transfer-config: invalid JSON"),
        (
            kv_config(1, kv_connector="FooConnector", kv_connector_module_path=None),
            "Unsupported connector type: FooConnector",
        ),
        (kv_config(1, kv_role=None), "Please specify kv_role"),
    ):
        done = setup.launcher.run([*argv, "--kv-transfer-config", config], env)
        assert done.returncode == 2, done.stderr
        assert message in done.stderr
    autostart = {"lmcache.mp.host": LOOPBACK, "lmcache.mp.port": 1, "lmcache.mp.autostart": True}
    engine = setup.vllm_engine(
        "--kv-transfer-config", kv_config(1, kv_connector_extra_config=autostart)
    )
    assert engine.wait_exit() == 1
    assert "lmcache.mp.autostart is not simulated" in engine.output()
    bare = installs.python("vllm", "0.17.0")  # no lmcache in that venv
    engine = setup.vllm_engine("--kv-transfer-config", kv_config(1), venv=bare)
    assert engine.wait_exit() == 1
    assert "ModuleNotFoundError: No module named 'lmcache'" in engine.output()


def test_vllm_builtin_connector_and_other_connectors(setup: Setup) -> None:
    server = setup.serving()
    builtin = json.loads(kv_config(server.zmq))
    del builtin["kv_connector_module_path"]
    engine = setup.vllm_engine("--kv-transfer-config", json.dumps(builtin))
    engine.wait_status(200)
    assert "Using vLLM's built-in LMCacheMPConnector" in engine.output()
    assert server.registered() == [1]
    assert engine.stop() == 0
    other = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    plain = setup.vllm_engine("--kv-transfer-config", other)
    plain.wait_status(200)
    answer = plain.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}]}
    )
    assert "prompt_tokens_details" not in answer.json()["usage"]
    assert server.registered() == []


# SGLang -------------------------------------------------------------------------------------


def test_sglang_registers_through_its_yaml_and_salts_share(setup: Setup) -> None:
    server = setup.serving()
    config = setup.sglang_config(server)
    engine = setup.sglang_engine("--enable-lmcache", "--lmcache-config-file", str(config))
    engine.wait_status(200)
    assert server.registered() == [1]
    assert cached(engine, salt="tenant-a") == 0
    assert cached(engine, salt="tenant-b") == CHUNKS
    assert cached(engine) == CHUNKS
    assert "Registered a sglang worker" in server.proc.output()


def test_sglang_reads_lmcache_config_file_from_its_environment(setup: Setup) -> None:
    server = setup.serving()
    config = setup.sglang_config(server)
    engine = setup.sglang_engine("--enable-lmcache", LMCACHE_CONFIG_FILE=str(config))
    engine.wait_status(200)
    assert server.registered() == [1]


def test_sglang_bypasses_lmcache_without_its_radix_cache(setup: Setup) -> None:
    server = setup.serving()
    config = str(setup.sglang_config(server))
    for flag in ("--disable-radix-cache", "--enable-hierarchical-cache"):
        engine = setup.sglang_engine("--enable-lmcache", "--lmcache-config-file", config, flag)
        engine.wait_status(200)
        answer = engine.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPT}]}
        )
        assert "prompt_tokens_details" not in answer.json()["usage"]
        assert engine.stop() == 0
    assert server.status()["active_sessions"] == 0
    assert "Registered a" not in server.proc.output()


def test_sglang_refuses_a_chunk_size_its_pages_do_not_divide(setup: Setup) -> None:
    server = setup.serving()
    config = str(setup.sglang_config(server))
    engine = setup.sglang_engine(
        "--enable-lmcache", "--lmcache-config-file", config, "--page-size", "48"
    )
    assert engine.wait_exit() == 1
    assert "chunk size 256 is not a multiple of the page size 48" in engine.output()
