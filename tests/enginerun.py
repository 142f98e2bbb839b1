"""Launching engines for tests exactly as CapyCTL does: detect, adapter plan, closed env."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import openai

from capycommon import simgpu
from capycommon.domain.commands import EngineTuning
from capycommon.domain.engines import Residency
from capycommon.engines import detect
from capycommon.engines.adapters import adapter_for
from capycommon.engines.control import EngineControl
from capycommon.engines.environment import engine_environment, install_runtime
from capycommon.engines.launch import LaunchSpec
from capycommon.engines.registry import EngineProfile
from ports import free_port
from support import group_members, wait_for

T = TypeVar("T")
KEY = "conformance-key-0123456789abcdef0123456789"


@dataclass
class RunningEngine:
    spec: LaunchSpec
    proc: subprocess.Popen[bytes]
    log: Path
    gpu_uuid: str
    simgpu_dir: Path | None
    clients: list[openai.OpenAI] = field(default_factory=list)  # closed by `stop`

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    def openai(self, key: str = KEY) -> openai.OpenAI:
        client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0)
        self.clients.append(client)
        return client

    def control(self, fn: Callable[[EngineControl], Awaitable[T]]) -> T:
        """Run one async control call with a fresh client."""

        async def run() -> T:
            control = adapter_for(self.spec.profile.family).control(self.spec)
            try:
                return await fn(control)
            finally:
                await control.aclose()

        return asyncio.run(run())

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def device_bytes(self) -> tuple[int, int]:
        """(device, host) bytes the engine's processes claim on the simulated GPU."""
        assert self.simgpu_dir is not None
        used = simgpu.usage(self.simgpu_dir).get(self.gpu_uuid)
        if used is None:
            return (0, 0)
        mine = [c for pid, c in used.by_pid.items() if pid in group_members(self.proc.pid)]
        return (sum(c.bytes for c in mine), sum(c.host_bytes for c in mine))

    def stop(self, timeout: float = 15) -> int | None:
        """SIGTERM to the whole process group, then SIGKILL, as hostd does."""
        for client in self.clients:
            client.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(timeout=5)


def make_devices(folder: Path, spec: str = "gpu0:24GiB") -> list[simgpu.Device]:
    devices = simgpu.parse_devices(spec)
    simgpu.write_devices(folder, devices)
    return devices


def sparse_model(folder: Path, size: int, gguf: bool = False) -> Path:
    """A model folder whose weight file has `size` bytes (sparse: it takes no disk)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    weights = folder / ("model.gguf" if gguf else "model.safetensors")
    with weights.open("wb") as handle:
        handle.truncate(size)
    return folder


def launch(
    install: Path | EngineProfile,
    work: Path,
    model: Path,
    *,
    residency: Residency = Residency.RESTART_ONLY,
    simgpu_dir: Path | None = None,
    memory_fraction: float | None = 0.5,
    context_length: int = 4096,
    gpu_memory_bytes: int = 12 << 30,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    wait_ready: bool = True,
) -> RunningEngine:
    """Register-style detection of `install` (or its profile, for a custom engine), then the
    adapter's launch, then readiness. `gpu_memory_bytes` is what a deployment's `resources`
    state (TensorFold is told it)."""
    if isinstance(install, EngineProfile):
        profile = install
    else:
        (found,) = detect.probe(install)
        profile = found.profile()
    runtime = work / "runtime"
    install_runtime(runtime)
    spec = LaunchSpec(
        profile=profile,
        model_path=model,
        served_name="tiny",
        port=free_port(),
        api_key=KEY,
        residency=residency,
        runtime_dir=runtime,
        tuning=EngineTuning(
            memory_fraction=memory_fraction,
            gpu_memory_bytes=gpu_memory_bytes,
            context_length=context_length,
            max_concurrent_requests=4,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
        ),
    )
    adapter = adapter_for(profile.family)
    plan = adapter.plan(spec)
    gpu = simgpu.read_devices(simgpu_dir)[0].uuid if simgpu_dir else simgpu.device_uuid("gpu0")
    env = engine_environment(spec, plan, gpu_uuid=gpu, home=work, simgpu_dir=simgpu_dir)
    log = work / f"engine-{spec.port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            plan.argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    engine = RunningEngine(spec, proc, log, gpu, simgpu_dir)
    if wait_ready:
        try:
            wait_for(
                lambda: _ready_or_dead(engine),
                timeout=60,
                what=f"{profile.family} to be ready",
                interval=0.2,
            )
        except BaseException:
            engine.stop()
            raise
    return engine


def _ready_or_dead(engine: RunningEngine) -> bool:
    if engine.proc.poll() is not None:
        raise AssertionError(f"the engine exited with {engine.proc.returncode}:\n{engine.output()}")
    return engine.control(lambda c: c.ready())
