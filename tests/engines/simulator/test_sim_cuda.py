"""The simulator's CUDA mode (ENGINESIM_CUDA=1) without a GPU: each family refuses to start
without torch, naming the fix; the holder's arithmetic against a recording stand-in for torch;
and vLLM's EngineCore holding, freeing and taking back its claim through a stand-in torch
package that writes what it holds to a ledger file (the real one needs a GPU:
scripts/gpu-check runs it there)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engines.simulator.helpers import (
    FAST,
    Engines,
    Launcher,
    SimGpu,
    claim,
    engine_core,
    env_for,
    group_alive,
    python_argv,
    wait_claim,
)
from enginesim import cuda, install_python_engine
from enginesim.gpu import NoHolder
from enginesim.install import add_packages
from faketorch import write_torch
from support import wait_for

VLLM = "0.17.0"
SGLANG = "0.5.10"
LLAMA_BUILD = 6500
RESIDUE = FAST.residue_bytes


class RecordingTorch:
    """torch's few calls the holder makes, recorded in order."""

    uint8 = "uint8"

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.cuda = self

    def empty(self, size: int, dtype: str, device: str) -> object:
        assert (dtype, device) == ("uint8", "cuda")
        self.calls.append(("alloc", size))
        return object()

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", 0))

    def synchronize(self) -> None:
        return None


class RecordingHolder(NoHolder):
    def __init__(self) -> None:
        self.sets: list[tuple[int, int]] = []
        self.closed = False

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        self.sets.append((gpu_bytes, host_bytes))

    def close(self) -> None:
        self.closed = True


def test_the_mode_is_on_for_any_value_but_empty_or_zero() -> None:
    assert not cuda.wanted({})
    assert not cuda.wanted({"ENGINESIM_CUDA": ""})
    assert not cuda.wanted({"ENGINESIM_CUDA": "0"})
    assert cuda.wanted({"ENGINESIM_CUDA": "1"})
    inner = RecordingHolder()
    assert cuda.wrap(inner, {}) is inner, "off: the claims alone"


def test_without_torch_the_refusal_names_the_fix() -> None:
    assert cuda.refusal({}) is None
    refused = cuda.refusal({"ENGINESIM_CUDA": "1"})
    assert refused is not None
    assert refused.startswith("ModuleNotFoundError: ENGINESIM_CUDA=1 needs torch")
    assert "-m pip install torch" in refused
    assert "unset ENGINESIM_CUDA" in refused
    with pytest.raises(cuda.CudaUnavailable, match="needs torch, which does not import"):
        cuda.wrap(RecordingHolder(), {"ENGINESIM_CUDA": "1"})


def test_the_holder_allocates_each_change_and_hands_releases_back_first() -> None:
    torch, inner = RecordingTorch(), RecordingHolder()
    holder = cuda.CudaHolder(inner, torch)
    holder.set(10, 0)
    holder.set(15, 3)
    assert (holder.held, torch.calls) == (15, [("alloc", 10), ("alloc", 5)])
    holder.set(12, 0)  # the last 5 go back to the driver before 2 are taken again
    assert holder.held == 12
    assert torch.calls[2:] == [("empty_cache", 0), ("alloc", 2)]
    holder.set(0, 12)  # a park: nothing left on the device
    assert (holder.held, torch.calls[4:]) == (0, [("empty_cache", 0)])
    holder.set(12, 0)  # a wake takes it all back in one allocation
    assert torch.calls[5:] == [("alloc", 12)]
    holder.close()
    assert holder.held == 0
    assert inner.sets == [(10, 0), (15, 3), (12, 0), (0, 12), (12, 0)]
    assert inner.closed, "the claims are closed with the memory"


@pytest.mark.parametrize("family", ["vllm", "sglang", "llamacpp"])
def test_each_family_refuses_to_start_without_torch(
    family: str, engines: Engines, gguf: Path, gpu: SimGpu
) -> None:
    on = {"ENGINESIM_CUDA": "1"}
    if family == "llamacpp":
        engine = engines.start_llama(LLAMA_BUILD, FAST, gguf, **on)
    elif family == "vllm":
        engine = engines.start("vllm", VLLM, FAST, **on)
    else:
        engine = engines.start("sglang", SGLANG, FAST, **on)
    assert engine.wait_exit() == 1
    output = engine.output()
    assert "ModuleNotFoundError: ENGINESIM_CUDA=1 needs torch" in output
    assert "-m pip install torch" in output
    assert "unset ENGINESIM_CUDA" in output
    assert gpu.claims() == {}, "nothing is claimed"
    assert not group_alive(engine.proc.pid)


@pytest.fixture(scope="module")
def torch_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A simulated vLLM whose venv sees the stand-in torch, as scripts/gpu-check makes one
    see the machine's torch."""
    root = tmp_path_factory.mktemp("cuda")
    venv = install_python_engine(root / "vllm", "vllm", VLLM, FAST)
    add_packages(venv, write_torch(root / "packages"))
    return venv


def held(ledger: Path, pid: int) -> int | None:
    """What the stand-in torch holds for `pid`, or None when that process allocated nothing."""
    path = ledger / f"{pid}.json"
    if not path.exists():
        return None
    found: dict[str, Any] = json.loads(path.read_text())
    return int(found["held"])


def test_vllm_holds_its_claim_as_device_memory_frees_it_asleep_and_takes_it_back(
    torch_venv: Path, model_dir: Path, gpu: SimGpu, launcher: Launcher, ledger: Path
) -> None:
    argv = python_argv("vllm", torch_venv, model_dir, "--enable-sleep-mode")
    on = {"ENGINESIM_CUDA": "1", "FAKE_TORCH_LEDGER": str(ledger), "VLLM_SERVER_DEV_MODE": "1"}
    engine = launcher.start(argv, env_for(torch_venv, ledger.parent, gpu, **on))
    engine.wait_status(200)
    core = engine_core(engine)
    budget = int(0.9 * gpu.total)
    wait_claim(gpu, core, (budget, 0))
    assert held(ledger, core) == budget, "the EngineCore holds its claim on the device"
    assert held(ledger, engine.proc.pid) is None, "the API server holds no device memory"
    assert engine.post("/sleep", params={"level": "2"}).status_code == 200
    wait_claim(gpu, core, (RESIDUE, 0))
    assert held(ledger, core) == RESIDUE
    assert engine.post("/wake_up").status_code == 200
    wait_claim(gpu, core, (budget, 0))
    assert held(ledger, core) == budget
    assert engine.stop() == 0
    assert held(ledger, core) == 0, "stopped: every tensor freed"
    assert claim(gpu, core) is None


def test_a_torch_that_sees_no_device_stops_the_engine_naming_it(
    torch_venv: Path, model_dir: Path, gpu: SimGpu, launcher: Launcher, ledger: Path
) -> None:
    argv = python_argv("vllm", torch_venv, model_dir)
    env = env_for(torch_venv, ledger.parent, gpu, ENGINESIM_CUDA="1", FAKE_TORCH_DEVICES="0")
    engine = launcher.start(argv, env)
    assert engine.wait_exit(timeout=30) != 0
    wait_for(lambda: "sees none" in engine.output(), 5, "the EngineCore's refusal")
    assert "EngineCore: RuntimeError: ENGINESIM_CUDA=1 needs a CUDA device" in engine.output()
    assert gpu.claims() == {}
