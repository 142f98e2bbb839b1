"""Helpers for the engine simulator's tests: simulated GPUs, launched engines, metrics."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from capycommon import simgpu
from enginesim import (
    Behaviour,
    ToolCall,
    install_llama_server,
    install_python_engine,
    write_behaviour,
)
from enginesim.install import PythonFamily
from ports import reserved_port
from support import children_of, group_members, wait_for

GIB = 1 << 30
MIB = 1 << 20
KEY = "sim-key"  # the API key of each engine served for a module's tests (`Servers`)
# Short timings keep the whole folder fast.
FAST = Behaviour(
    load_seconds=0.3,
    warmup_seconds=0.2,
    sleep_seconds=0.05,
    wake_seconds=0.05,
    tokens_per_second=200,
    memory_lag_seconds=0.05,
)
# Slow generation, so a request is still running while the test acts on it.
SLOW = FAST.model_copy(update={"tokens_per_second": 5, "answer": " ".join(["word"] * 60)})
# What the engines kept up for a whole test module say: reasoning, and a call when given tools.
REASONS_AND_CALLS = FAST.model_copy(
    update={
        "reasoning": "Thinking it over.",
        "tool_call": ToolCall(name="get_weather", arguments={"city": "Paris"}),
    }
)
# The same at a readable pace, with an answer long enough to act on while it streams.
TALKATIVE = REASONS_AND_CALLS.model_copy(
    update={
        "tokens_per_second": 40,
        "answer": "Hello from the engine simulator. " + " ".join(["more"] * 40),
    }
)
HELLO: list[Any] = [{"role": "user", "content": "Say hello to me"}]
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
# Each Python family's server module and its model flag.
SERVER_MODULES: dict[PythonFamily, tuple[str, str]] = {
    "vllm": ("vllm.entrypoints.openai.api_server", "--model"),
    "sglang": ("sglang.launch_server", "--model-path"),
}


def parse_metric(text: str, name: str) -> float:
    """The sum over labels of one metric's samples in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name or sample.startswith(name + "{"):
            total += float(value)
    return total


class Installs:
    """Simulated engine installs, made on first use and shared by the session."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._made: dict[str, Path] = {}

    def python(self, family: PythonFamily, version: str) -> Path:
        name = f"{family}-{version}"
        if name not in self._made:
            venv = self.folder / name
            self._made[name] = install_python_engine(venv, family, version, FAST)
        return self._made[name]

    def llama(self, build: int) -> Path:
        name = f"llama-{build}"
        if name not in self._made:
            self._made[name] = install_llama_server(self.folder / name, build, FAST)
        return self._made[name]

    def tensorfold(self, version: str) -> Path:
        """The executable `tensorfold` at `version` (CapyCTL's assumed TensorFold)."""
        from enginesim import install_tensorfold

        name = f"tensorfold-{version}"
        if name not in self._made:
            self._made[name] = install_tensorfold(self.folder / name, version, FAST)
        return self._made[name]


@dataclass(frozen=True)
class SimGpu:
    folder: Path
    uuid: str
    total: int

    def env(self) -> dict[str, str]:
        return {"CAPYCTL_SIMGPU_DIR": str(self.folder), "CUDA_VISIBLE_DEVICES": self.uuid}

    def claims(self) -> dict[int, simgpu.Claim]:
        """The claims of live processes on this device, by pid."""
        found = simgpu.usage(self.folder).get(self.uuid)
        return dict(found.by_pid) if found else {}

    def claim_file(self, pid: int) -> Path:
        return self.folder / f"{pid}.json"

    def occupy(self, size: int) -> None:
        """Claim `size` bytes for this (live) test process, as another engine would."""
        simgpu.write_claim(self.folder, os.getpid(), simgpu.Claim(uuid=self.uuid, bytes=size))


@dataclass(frozen=True)
class Devices:
    """Simulated devices in one folder (the `devices` fixture: four of 24 GiB)."""

    folder: Path
    gpus: list[SimGpu]

    def env(self, visible: int) -> dict[str, str]:
        """What an engine that sees the first `visible` devices gets, as hostd sets it."""
        uuids = ",".join(gpu.uuid for gpu in self.gpus[:visible])
        return {"CAPYCTL_SIMGPU_DIR": str(self.folder), "CUDA_VISIBLE_DEVICES": uuids}

    def live_claims(self) -> dict[int, simgpu.Claim]:
        """Every claim of a live process, on any device, by PID."""
        return {pid: found for gpu in self.gpus for pid, found in gpu.claims().items()}

    def claim_files(self) -> list[str]:
        return sorted(path.name for path in self.folder.glob("*.json") if path.stem.isdigit())


def claim(gpu: SimGpu, pid: int) -> tuple[int, int] | None:
    """(device bytes, host bytes) that `pid` claims, or None without a claim."""
    found = gpu.claims().get(pid)
    return (found.bytes, found.host_bytes) if found else None


def wait_claim(gpu: SimGpu, pid: int, expected: tuple[int, int] | None) -> None:
    wait_for(lambda: claim(gpu, pid) == expected, 10, f"pid {pid} to claim {expected}")


def make_simgpu(folder: Path, total: int = 24 * GIB) -> SimGpu:
    device = simgpu.parse_devices(f"gpu0:{total // GIB}GiB")[0]
    simgpu.write_devices(folder, [device])
    return SimGpu(folder, device.uuid, device.total_bytes)


def sparse_file(path: Path, size: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:
        handle.truncate(size)
    return path


def closed_env(bin_dir: Path | None, home: Path, **extra: str) -> dict[str, str]:
    """The closed environment CapyCTL starts engines with."""
    path = f"{bin_dir}:/usr/bin:/bin" if bin_dir else "/usr/bin:/bin"
    return {
        "PATH": path,
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_NO_USAGE_STATS": "1",
        **extra,
    }


def python_argv(family: PythonFamily, venv: Path, model: Path, *extra: str) -> list[str]:
    """`python -m <server module> <model flag> MODEL --port {port} EXTRA` from an install."""
    module, model_flag = SERVER_MODULES[family]
    python = str(venv / "bin" / "python")
    return [python, "-m", module, model_flag, str(model), "--port", "{port}", *extra]


def env_for(venv: Path, home: Path, gpu: SimGpu, **extra: str) -> dict[str, str]:
    """The closed environment of an engine from `venv` that sees the simulated `gpu`."""
    return closed_env(venv / "bin", home, **gpu.env(), **extra)


def llama_argv(executable: Path, model: Path, *extra: str) -> list[str]:
    """`llama-server -m MODEL --port {port} EXTRA` from an install."""
    return [str(executable), "-m", str(model), "--port", "{port}", *extra]


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    key: str | None = None
    clients: list[openai.OpenAI] = field(default_factory=list)  # closed at cleanup

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def get(
        self, path: str, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> httpx.Response:
        return httpx.get(
            self.base + path, headers={**self.headers, **(headers or {})}, timeout=10, **kwargs
        )

    def post(
        self, path: str, headers: dict[str, str] | None = None, **kwargs: Any
    ) -> httpx.Response:
        return httpx.post(
            self.base + path, headers={**self.headers, **(headers or {})}, timeout=30, **kwargs
        )

    def openai(self) -> openai.OpenAI:
        client = openai.OpenAI(
            base_url=f"{self.base}/v1", api_key=self.key or "none", max_retries=0
        )
        self.clients.append(client)
        return client

    def status(self, path: str = "/health") -> int | None:
        """The HTTP status of `path`, or None while the port refuses connections."""
        try:
            return httpx.get(self.base + path, headers=self.headers, timeout=5).status_code
        except httpx.TransportError:
            return None

    def wait_status(self, status: int, path: str = "/health", timeout: float = 20) -> None:
        def reached() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"the engine exited {self.proc.returncode}:\n{self.output()}")
            return self.status(path) == status

        wait_for(reached, timeout, f"{path} to answer {status}")

    def metric(self, name: str) -> float:
        return parse_metric(self.get("/metrics").text, name)

    def wait_exit(self, timeout: float = 20) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit()


@dataclass
class Launcher:
    """Starts engines in their own process group; kills every group left at teardown."""

    folder: Path
    started: list[Engine] = field(default_factory=list)
    # The ports held for the processes of the test, until its cleanup (`reserved_port`).
    held: list[socket.socket] = field(default_factory=list)

    def reserve(self, count: int = 1) -> list[int]:
        """`count` ports the system chose, held for the test's processes until its cleanup:
        none is given to anyone else meanwhile, even between a process and its restart."""
        held = [reserved_port() for _ in range(count)]
        self.held += held
        return [int(sock.getsockname()[1]) for sock in held]

    def start(
        self, argv: list[str], env: dict[str, str], port: int | None = None, key: str | None = None
    ) -> Engine:
        """Start `argv` with `{port}` replaced by `port` (by default, one held for it)."""
        port = port or self.reserve()[0]
        log = self.folder / f"engine-{len(self.started)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [part.replace("{port}", str(port)) for part in argv],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        engine = Engine(proc, port, log, key)
        self.started.append(engine)
        return engine

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=30, check=False
        )

    def cleanup(self) -> None:
        for engine in self.started:
            for client in engine.clients:
                client.close()
            with_group_killed(engine.proc.pid)
            if engine.proc.poll() is None:
                engine.proc.wait(timeout=10)
        for sock in self.held:
            sock.close()


@dataclass(frozen=True)
class Engines:
    """Starts simulated engines from the session's installs, on the test's GPU."""

    installs: Installs
    model: Path
    gpu: SimGpu
    launcher: Launcher
    home: Path

    def start(
        self,
        family: PythonFamily,
        version: str,
        behaviour: Behaviour,
        *extra: str,
        key: str | None = None,
        **env: str,
    ) -> Engine:
        """Launch `family` at `version` with `behaviour` (its module form, extra arguments
        and environment variables added); it may still be loading."""
        venv = self.installs.python(family, version)
        write_behaviour(venv, behaviour)
        argv = python_argv(family, venv, self.model, *extra)
        return self.launcher.start(argv, env_for(venv, self.home, self.gpu, **env), key=key)

    def start_llama(
        self, build: int, behaviour: Behaviour, model: Path, *extra: str, **env: str
    ) -> Engine:
        """Launch llama-server of `build` with `behaviour`, serving `model` (extra arguments
        and environment variables added); it may still be loading."""
        executable = self.installs.llama(build)
        write_behaviour(executable, behaviour)
        argv = llama_argv(executable, model, *extra)
        return self.launcher.start(argv, self.closed_env(**self.gpu.env(), **env))

    def closed_env(self, **extra: str) -> dict[str, str]:
        """The closed environment of an engine of the test's that sees no GPU (`extra`
        added): for an install's executables run as they are."""
        return closed_env(None, self.home, **extra)


@contextmanager
def serving(folder: Path, argv: list[str], env: dict[str, str], key: str) -> Iterator[Engine]:
    """An engine up and serving for a module's tests; its process group is killed after."""
    launcher = Launcher(folder)
    engine = launcher.start(argv, env, key=key)
    try:
        engine.wait_status(200)
        yield engine
    finally:
        launcher.cleanup()


@dataclass(frozen=True)
class Servers:
    """Engines up and serving for a module's tests, from the session's installs: each behind
    `KEY`, on its own simulated GPU, in a new folder named after it; its process group is
    killed after."""

    installs: Installs
    model: Path  # the session's model folder
    gguf: Path  # the session's GGUF
    folders: pytest.TempPathFactory

    def python(
        self,
        name: str,
        family: PythonFamily,
        version: str,
        behaviour: Behaviour,
        *extra: str,
        model: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> AbstractContextManager[Engine]:
        """`family` at `version` with `behaviour`, serving `model` (else the session's) behind
        `--api-key`, with `env` added to its environment."""
        folder = self.folders.mktemp(name)
        venv = self.installs.python(family, version)
        write_behaviour(venv, behaviour)
        argv = python_argv(family, venv, model or self.model, "--api-key", KEY, *extra)
        gpu = make_simgpu(folder / "simgpu")
        return serving(folder, argv, env_for(venv, folder, gpu, **(env or {})), KEY)

    def llama(
        self, name: str, build: int, behaviour: Behaviour, *extra: str, model: Path | None = None
    ) -> AbstractContextManager[Engine]:
        """llama-server of `build` with `behaviour`, serving `model` (else the session's GGUF)
        behind `LLAMA_API_KEY`."""
        folder = self.folders.mktemp(name)
        executable = self.installs.llama(build)
        write_behaviour(executable, behaviour)
        gpu = make_simgpu(folder / "simgpu")
        env = closed_env(None, folder, **gpu.env(), LLAMA_API_KEY=KEY)
        return serving(folder, llama_argv(executable, model or self.gguf, *extra), env, KEY)


def engine_core(engine: Engine, timeout: float = 10) -> int:
    """vLLM's EngineCore: the API server's child."""
    found = wait_for(lambda: children_of(engine.proc.pid), timeout, "the EngineCore child")
    return found[0]


def with_group_killed(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    wait_group_ended(pgid)


def wait_group_ended(pgid: int) -> None:
    """Wait until no process of the group `pgid` lives."""
    wait_for(lambda: not group_alive(pgid), 10, f"process group {pgid} to end")


def group_alive(pgid: int) -> bool:
    return bool(group_members(pgid))


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    """Decoded `data:` payloads of an SSE body; `[DONE]` stays a string."""
    for line in lines:
        if line.startswith("data: "):
            payload = line.removeprefix("data: ")
            yield payload if payload == "[DONE]" else json.loads(payload)


@contextmanager
def streaming(engine: Engine, body: dict[str, object]) -> Iterator[Iterator[dict[str, Any] | str]]:
    """A streamed chat request held open once its first content has come: the test acts on
    the running request, then reads the rest of its events."""
    with httpx.stream(
        "POST", f"{engine.base}/v1/chat/completions", json=body, headers=engine.headers
    ) as streamed:
        events = sse_events(streamed.iter_lines())
        next(e for e in events if isinstance(e, dict) and e["choices"][0]["delta"].get("content"))
        yield events


def send_and_hang_up(
    port: int, path: str, body: dict[str, object], key: str | None
) -> socket.socket:
    """Send one request on a raw socket (kept open); the caller closes it to hang up."""
    data = json.dumps(body).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"{auth}Content-Length: {len(data)}\r\n\r\n"
    )
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head.encode() + data)
    return sock


def site_packages(venv: Path) -> Path:
    return next(venv.glob("lib/python3*/site-packages"))


def recorded(venv: Path, name: str, version: str) -> list[tuple[Path, str]]:
    """(file, recorded sha256) for every hashed RECORD line of the installed dist."""
    packages = site_packages(venv)
    lines = (packages / f"{name}-{version}.dist-info" / "RECORD").read_text().splitlines()
    found = []
    for line in lines:
        path, digest, _ = line.rsplit(",", 2)
        if digest:
            found.append(((packages / path).resolve(), digest.removeprefix("sha256=")))
    return found


def sha256(path: Path) -> str:
    """A file's sha256 as a wheel's RECORD writes it."""
    digest = hashlib.sha256(path.read_bytes()).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
