"""The role that steps 4 to 6 share: a standalone role on the real GPU whose one engine is the
engine simulator, registered as vLLM, in its CUDA mode (`enginesim.cuda`): each model's
memory is a real allocation in the engine's EngineCore process, so memwatch, the ledger's
readings and nvidia-smi see it as a real engine's.

The engine's venv is made with this Python and sees the machine's torch (the folder holding
it added after its own packages). Each deployment is pinned to the GPU with the most free
memory, parks deep (a park frees all its memory but the CUDA context: the behaviour keeps no
residue of its own, the real context stands for it), never idles out, declares the memory its
engine takes (weights of sparse files plus its KV cache) and sets ENGINESIM_CUDA=1 in the
engine's environment, the way a deployment sets any engine variable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from capycommon import credentials
from capycommon import management as wire
from capycommon.engines import detect, registry
from capycommon.errors import CapyError
from capycommon.units import format_size_exact
from capyctl_cli import record
from capyctl_cli.gpucheck.devicewatch import DeviceWatch, Gpu, Reading
from capyctl_cli.gpucheck.machine import Torch
from capyctl_cli.gpucheck.report import Fail
from capyctl_cli.gpucheck.role import HOST, Role, end_left_under, until, write_document
from capyctl_cli.output import echo
from enginesim.behaviour import Behaviour
from enginesim.cuda import CUDA_ENV
from enginesim.install import add_packages, install_python_engine

MiB = 1 << 20
ENGINE = "vllm-on-cuda"
VLLM = "0.29.0"
GiB = 1 << 30
# A second of loading at the start-up peak (the claim and 1 GiB more, as a real engine's
# profiling takes), so memwatch's 500 ms samples of a start catch it.
BEHAVIOUR = Behaviour(
    load_seconds=1.0,
    startup_extra_bytes=GiB,
    sleep_seconds=0.1,
    wake_seconds=0.2,
    tokens_per_second=500,
    residue_bytes=0,
    memory_lag_seconds=0.0,
    answer="Hello from the GPU check.",
)
ASK_TIMEOUT_S = 300.0
POLL_S = 0.05


def install_engine(folder: Path, torch: Torch, document: Path) -> None:
    """The simulator as vLLM in `folder/engine`, seeing `torch`, registered beside the
    role document."""
    venv = install_python_engine(folder / "engine", "vllm", VLLM, BEHAVIOUR)
    add_packages(venv, torch.packages)
    (found,) = detect.probe(venv)
    registry.add(document.parent / registry.FILE_NAME, found.profile(ENGINE))


def sparse_model(folder: Path, size: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    with (folder / "model.safetensors").open("wb") as weights:
        weights.truncate(size)  # sparse: it takes no disk
    return folder


@dataclass
class Bench:
    folder: Path
    role: Role
    watch: DeviceWatch
    gpu: Gpu
    domain: wire.HostDomain

    @classmethod
    def open(cls, folder: Path, watch: DeviceWatch, torch: Torch, env: dict[str, str]) -> Bench:
        document = write_document(folder)
        install_engine(folder, torch, document)
        role = Role.start(folder, env)
        gpu = max(watch.first.gpus, key=lambda g: g.free)
        try:
            with role.api() as api:
                (host,) = (h for h in api.hosts() if h.name == HOST)
        except BaseException:
            role.stop()
            raise
        domain = next(d for d in host.domains if d.name == f"gpu{gpu.index}")
        return cls(folder, role, watch, gpu, domain)

    def room(self) -> int:
        """What deployments may take on the GPU: its managed limit, or what was free at the
        start less the free reserve, the smaller."""
        return min(self.domain.managed_limit, self.gpu.free - self.domain.free_reserve)

    def ours(self, reading: Reading) -> int:
        return self.watch.ours(reading)

    def deploy(self, name: str, claim: int, kv: int) -> None:
        """A deployment whose engine holds `claim` bytes: `claim - kv` of weights, `kv` of
        KV cache."""
        model = sparse_model(self.folder / "models" / name, claim - kv)
        memory: wire.JsonObject = {
            "request": format_size_exact(claim),
            "kv_cache": format_size_exact(kv),
        }
        document: wire.JsonObject = {
            "name": name,
            "engine": ENGINE,
            "model": {"path": str(model)},
            "residency": "deep",
            "lmcache": "off",
            "devices": [{"id": f"gpu{self.gpu.index}"}],
            "engine_config": {"memory": memory, "env": {CUDA_ENV: "1"}},
            "lifecycle": {"ready_idle_timeout": "never", "parked_idle_timeout": "never"},
        }
        with self.role.api() as api:
            api.deploy(document)

    def act(self, name: str, action: wire.Action) -> float:
        """Ask for `action`; when it was asked (monotonic)."""
        asked = time.monotonic()
        with self.role.api() as api:
            api.act(name, action)
        return asked

    def reach(self, name: str, state: str, timeout: float) -> float:
        """When (monotonic) the deployment was first seen in `state`, polled every 50 ms;
        Fail on a failed start, a refusal or the deadline."""
        asked = time.time()
        deadline = time.monotonic() + timeout
        with self.role.api() as api:
            failures = api.status(name).attempts.count
            while True:
                found = api.status(name)
                if found.state == state:
                    return time.monotonic()
                if found.attempts.failed or found.attempts.count > failures:
                    raise Fail(f"{name} failed to start: {found.attempts.last_error}")
                if found.refusal is not None and found.refusal.at >= asked:
                    raise Fail(f"{name}: error [{found.refusal.code}] {found.refusal.message}")
                if time.monotonic() > deadline:
                    last = found.last_operation.reason if found.last_operation else "nothing"
                    raise Fail(
                        f"{name} is {found.state}, not {state}, after {timeout:.0f} s: {last}"
                    )
                time.sleep(POLL_S)

    def ready_ones(self) -> list[str]:
        with self.role.api() as api:
            return sorted(d.name for d in api.deployments() if d.state == "ready")

    def startup_peak(self, name: str) -> int:
        """memwatch's measured startup peak of the deployment's engine (the device bytes its
        process group held at most while it started), as memwatch stored it."""
        running = record.read(self.role.paths)
        assert running is not None

        def measured() -> int | None:
            with record.state_of(running, timeout=5) as state:
                peak = state(lambda s: s.memory.instance_peak(HOST, name, 0))
            return None if peak is None else peak.device_bytes

        return until(measured, 15, f"memwatch's measured startup peak of {name}", 0.25)

    def ask(self, name: str) -> float:
        """One chat request to `name` through the role's OpenAI endpoint, answered; the
        seconds it took."""
        key = credentials.load(self.role.paths.credentials).api_key
        body = {"model": name, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
        asked = time.monotonic()
        answer = httpx.post(
            f"http://{self.role.inference}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=ASK_TIMEOUT_S,
        )
        if answer.status_code != 200:
            raise Fail(f"{name} answered {answer.status_code}: {answer.text[:300]}")
        if not answer.json()["choices"][0]["message"]["content"]:
            raise Fail(f"{name} answered with no content: {answer.text[:300]}")
        return time.monotonic() - asked

    def delete(self, name: str) -> None:
        self.act(name, "delete")
        with self.role.api() as api:
            until(lambda: name not in {d.name for d in api.deployments()}, 120, f"{name} gone")

    def drain(self) -> None:
        """Every engine of the host stopped: drained, then waited for."""
        with self.role.api() as api:
            api.drain(HOST)
            until(
                lambda: not any(d.hosts for d in api.deployments()),
                120,
                "every engine stopped by the drain",
            )

    def close(self) -> None:
        """The role stopped, and whatever a failed step left ended: a drain first while the
        role runs, else (it failed too) the processes by PID."""
        try:
            if self.role.proc.poll() is None:
                self.drain()
        except (CapyError, Fail) as exc:
            echo(f"gpu-check: the drain at the end failed ({exc}); ending by PID", err=True)
        finally:
            self.role.stop()
            end_left_under(self.folder)
