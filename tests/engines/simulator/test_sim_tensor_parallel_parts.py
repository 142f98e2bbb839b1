"""Tensor parallelism's parts: the visible devices in CUDA's order, shares of bytes, the
model's head count, llama.cpp's proportions, the spread claim, and the CUDA mode, where each
rank holds real memory on its own torch device (through a stand-in torch with several devices
that writes what each process holds on each device to a ledger file)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from capycommon import simgpu
from engines.simulator.helpers import (
    FAST,
    GIB,
    MIB,
    Devices,
    Installs,
    Launcher,
    claim,
    closed_env,
    engine_core,
    llama_argv,
    python_argv,
    wait_claim,
    wait_group_ended,
)
from enginesim import cuda, write_behaviour
from enginesim.gpu import NoDevice, SimDevice, Spread, find_device, find_devices
from enginesim.llamacpp import proportions
from enginesim.parallel import attention_heads, indivisible_heads, per_rank, split_bytes
from faketorch import SEVERAL_DEVICES, write_torch
from support import live_processes, wait_for

VLLM = "0.17.0"
LLAMA_BUILD = 6500
RESIDUE = FAST.residue_bytes


def _devices(folder: Path, spec: str) -> list[simgpu.Device]:
    listed = simgpu.parse_devices(spec)
    simgpu.write_devices(folder, listed)
    return listed


def test_the_visible_devices_in_cuda_order_up_to_the_first_unknown(tmp_path: Path) -> None:
    listed = _devices(tmp_path, "gpu0:24GiB,gpu1:24GiB,gpu2:24GiB")
    folder = {"CAPYCTL_SIMGPU_DIR": str(tmp_path)}

    def seen(visible: str | None) -> list[int]:
        env = folder if visible is None else {**folder, "CUDA_VISIBLE_DEVICES": visible}
        found = find_devices(env)
        assert found is not None
        return [device.device.index for device in found]

    assert seen(None) == [0, 1, 2]
    assert seen(f"{listed[2].uuid},{listed[0].uuid}") == [2, 0]
    assert seen("1, 2") == [1, 2]
    assert seen(f"{listed[1].uuid},GPU-nope,{listed[2].uuid}") == [1], "CUDA stops there"
    assert seen("0,0,1") == [0], "as at a device named twice"
    one = find_device({**folder, "CUDA_VISIBLE_DEVICES": f"{listed[1].uuid},{listed[0].uuid}"})
    assert one is not None
    assert one.device.uuid == listed[1].uuid, "a single-GPU engine takes the first"
    with pytest.raises(NoDevice):
        find_devices({**folder, "CUDA_VISIBLE_DEVICES": "GPU-nope,0"})
    assert find_devices({"CUDA_VISIBLE_DEVICES": "0,1"}) is None, "simulation off"


def test_shares_of_bytes() -> None:
    assert per_rank(2 * GIB, 2) == GIB
    assert per_rank(7, 2) == 4, "rounded up: no byte is left out"
    assert split_bytes(100, [1, 1]) == [50, 50]
    assert split_bytes(101, [3, 1]) == [76, 25]
    assert split_bytes(10, [0, 1, 1]) == [0, 5, 5]
    assert sum(split_bytes(1000003, [1, 1, 1])) == 1000003
    with pytest.raises(ValueError, match="all zero"):
        split_bytes(10, [0, 0])


def test_the_head_count_from_config_json(tmp_path: Path) -> None:
    assert attention_heads(tmp_path) is None, "no config.json"
    (tmp_path / "config.json").write_text("{not json")
    assert attention_heads(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    assert attention_heads(tmp_path) is None
    nested = {"text_config": {"num_attention_heads": 40}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert attention_heads(tmp_path) == 40
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 14}))
    assert (indivisible_heads(tmp_path, 2), indivisible_heads(tmp_path, 4)) == (None, 14)


def test_llama_tensor_split_proportions() -> None:
    assert proportions("1,1") == (1.0, 1.0)
    assert proportions("3/1") == (3.0, 1.0)
    assert proportions("0.5,0,1") == (0.5, 0.0, 1.0)
    for bad in ("a,b", "1,-1", "1,,", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            proportions(bad)


def test_a_spread_claim_names_the_first_device_and_the_others_in_also(tmp_path: Path) -> None:
    listed = _devices(tmp_path, "gpu0:24GiB,gpu1:24GiB,gpu2:24GiB")
    on = tuple(SimDevice(tmp_path, device) for device in listed)
    spread = Spread(on, (2.0, 1.0, 1.0))
    assert spread.claim(400, 7) == simgpu.Claim(
        uuid=listed[0].uuid,
        bytes=200,
        host_bytes=7,
        also={listed[1].uuid: 100, listed[2].uuid: 100},
    )
    assert Spread.one(on[1]).claim(5, 0) == simgpu.Claim(uuid=listed[1].uuid, bytes=5)


class PlacingTorch:
    """torch's few calls a holder makes on several devices, recorded with the device."""

    uint8 = "uint8"

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.cuda = self
        self.current = "current"

    def empty(self, size: int, dtype: str, device: str) -> object:
        self.calls.append((f"alloc {size}", device))
        return object()

    def device(self, index: int) -> PlacingTorch:
        self.current = f"cuda:{index}"
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.current = "current"

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", self.current))

    def synchronize(self) -> None:
        return None


def test_the_cuda_holder_splits_over_the_devices_it_is_placed_on() -> None:
    torch = PlacingTorch()
    holder = cuda.CudaHolder(cuda_inner := _Inner(), torch, [(0, 3.0), (1, 1.0)])
    holder.set(400, 0)
    assert torch.calls == [("alloc 300", "cuda:0"), ("alloc 100", "cuda:1")]
    holder.set(200, 0)
    assert torch.calls[2:] == [
        ("empty_cache", "cuda:0"),
        ("alloc 150", "cuda:0"),
        ("empty_cache", "cuda:1"),
        ("alloc 50", "cuda:1"),
    ]
    assert holder.held == 200
    holder.close()
    assert (holder.held, cuda_inner.closed) == (0, True)
    rank = cuda.CudaHolder(_Inner(), PlacingTorch(), [(3, 1.0)])
    rank.set(10, 0)
    assert rank.held == 10


class _Inner:
    def __init__(self) -> None:
        self.closed = False

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        return None

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def torch_path(tmp_path: Path) -> Path:
    return write_torch(tmp_path / "packages", SEVERAL_DEVICES)


def held(ledger: Path, pid: int) -> dict[str, int] | None:
    """What the stand-in torch holds for `pid`, by device index; None: it allocated nothing."""
    path = ledger / f"{pid}.json"
    if not path.exists():
        return None
    found: dict[str, int] = json.loads(path.read_text())
    return found


def _cuda_env(torch_path: Path, ledger: Path, devices: Devices) -> dict[str, str]:
    """The CUDA mode's variables for an engine that sees the first two devices."""
    return {
        "ENGINESIM_CUDA": "1",
        "PYTHONPATH": str(torch_path),
        "FAKE_TORCH_LEDGER": str(ledger),
        **devices.env(2),
    }


@dataclass(frozen=True)
class TwoRanks:
    """The simulated vLLM across the first two of four devices in the CUDA mode."""

    argv: list[str]
    bin_dir: Path
    home: Path
    mode: dict[str, str]  # the variables of the CUDA mode

    def env(self, **extra: str) -> dict[str, str]:
        return closed_env(self.bin_dir, self.home, **extra, **self.mode)


@pytest.fixture
def two_ranks(
    installs: Installs,
    model_dir: Path,
    torch_path: Path,
    ledger: Path,
    devices: Devices,
    tmp_path: Path,
) -> TwoRanks:
    venv = installs.python("vllm", VLLM)
    write_behaviour(venv, FAST)
    argv = python_argv("vllm", venv, model_dir, "--tensor-parallel-size", "2")
    mode = _cuda_env(torch_path, ledger, devices)
    return TwoRanks(argv, venv / "bin", tmp_path, mode)


def test_each_vllm_worker_holds_real_memory_on_its_own_device(
    two_ranks: TwoRanks, launcher: Launcher, ledger: Path, devices: Devices
) -> None:
    argv = [*two_ranks.argv, "--enable-sleep-mode"]
    engine = launcher.start(argv, two_ranks.env(VLLM_SERVER_DEV_MODE="1"))
    engine.wait_status(200)
    core = engine_core(engine)
    workers = wait_for(lambda: _titled_children(core), 10, "the two workers")
    share = int(0.9 * 24 * GIB)
    for rank, gpu in enumerate(devices.gpus[:2]):
        worker = workers[f"VLLM::Worker_TP{rank}"]
        assert claim(gpu, worker) == (share, 0)
        assert held(ledger, worker) == {str(rank): share}, "on torch device <rank>"
    assert (held(ledger, engine.proc.pid), held(ledger, core)) == (None, None)
    assert engine.post("/sleep", params={"level": "2"}).status_code == 200
    for rank, gpu in enumerate(devices.gpus[:2]):
        wait_claim(gpu, workers[f"VLLM::Worker_TP{rank}"], (RESIDUE, 0))
        assert held(ledger, workers[f"VLLM::Worker_TP{rank}"]) == {str(rank): RESIDUE}
    assert engine.stop() == 0
    for rank in range(2):
        assert held(ledger, workers[f"VLLM::Worker_TP{rank}"]) == {}, "stopped: all freed"


def _titled_children(parent: int) -> dict[str, int] | None:
    found = {p.cmdline.split(" ")[0]: p.pid for p in live_processes() if p.ppid == parent}
    return found if len(found) == 2 else None


def test_a_worker_whose_torch_lacks_its_device_stops_the_engine(
    two_ranks: TwoRanks, launcher: Launcher, devices: Devices
) -> None:
    engine = launcher.start(two_ranks.argv, two_ranks.env(FAKE_TORCH_DEVICES="1"))
    assert engine.wait_exit(timeout=30) != 0
    output = engine.output()
    assert "rank 1: RuntimeError: ENGINESIM_CUDA=1 needs CUDA device 1, and torch sees 1" in output
    assert "Worker proc VllmWorker-1 died unexpectedly" in output
    wait_group_ended(engine.proc.pid)
    assert all(gpu.claims() == {} for gpu in devices.gpus)


def test_llama_holds_each_devices_share_on_that_device(
    installs: Installs,
    launcher: Launcher,
    gguf: Path,
    torch_path: Path,
    ledger: Path,
    devices: Devices,
    tmp_path: Path,
) -> None:
    executable = installs.llama(LLAMA_BUILD)
    write_behaviour(executable, FAST)
    argv = llama_argv(executable, gguf, "--tensor-split", "1,1")
    env = closed_env(None, tmp_path, **_cuda_env(torch_path, ledger, devices))
    engine = launcher.start(argv, env)
    engine.wait_status(200)
    need = GIB + 4096 * 128 * 1024 + 4 * 8 * MIB
    assert held(ledger, engine.proc.pid) == {"0": need // 2, "1": need // 2}
    assert claim(devices.gpus[1], engine.proc.pid) == (need // 2, 0)
    assert engine.stop() == 0
    assert held(ledger, engine.proc.pid) == {}
