"""Real device memory behind the simulator's claims: the CUDA mode, `ENGINESIM_CUDA=1`.

With `ENGINESIM_CUDA=1` in the engine's environment, every claim the simulated engine makes on
its device is also made as a real CUDA allocation through torch, in the process that holds the
claim (vLLM's EngineCore child; the SGLang and llama-server process itself), resized when the
claim changes and freed when it shrinks (a park) or the engine stops. NVML, and so memwatch,
nvidia-smi and everything above them, then see the engine's memory as they see a real
engine's: credited to the engine's processes, with the real CUDA context on top and the real
delay before a release shows. `scripts/gpu-check` runs the product on a real GPU this way.

What a claim holds follows the launch as it does without a GPU: the weights (the model's
weight files, sparse files standing in for big models) and the KV cache the launch names
(vLLM's `--kv-cache-memory-bytes`, which a deployment's `memory.kv_cache` sets); with
simulated GPUs (`CAPYCTL_SIMGPU_DIR`) the budget of the simulated device, whose claim files
are still written. Bytes a park keeps in host RAM are accounted in the claim only: no host
memory is taken for them. A parked engine keeps its `residue_bytes` on the device besides
the real CUDA context; a behaviour with `residue_bytes: 0` leaves the context alone there.

The variable is not a `CAPYCTL_*` one: hostd starts engines with a closed environment, the
deployment's `engine_config.env` is how a variable reaches one, and a deployment may not set
`CAPYCTL_*` variables. Any value but empty or `0` turns the mode on. Where torch cannot be
imported by the engine's Python, or sees no CUDA device, the engine refuses to start with a
message that names the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from enginesim.gpu import Holder

CUDA_ENV = "ENGINESIM_CUDA"


class CudaUnavailable(Exception):
    """The CUDA mode is asked for and cannot run here; the message names the fix."""


def wanted(env: Mapping[str, str]) -> bool:
    """Whether the environment asks for the CUDA mode."""
    return env.get(CUDA_ENV, "") not in ("", "0")


def _fix() -> str:
    return (
        f"install torch with CUDA for the engine's Python ({sys.executable}), e.g. "
        f"`{sys.executable} -m pip install torch`, or unset {CUDA_ENV}"
    )


def refusal(env: Mapping[str, str]) -> str | None:
    """Why the CUDA mode cannot run in this process, found without importing torch (which
    takes seconds): None when it is off or torch can be found."""
    if not wanted(env) or importlib.util.find_spec("torch") is not None:
        return None
    return f"ModuleNotFoundError: {CUDA_ENV}=1 needs torch, and there is no torch here: {_fix()}"


def load_torch() -> Any:
    """torch, once it imports and sees a CUDA device; else CudaUnavailable naming the fix."""
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        raise CudaUnavailable(
            f"ModuleNotFoundError: {CUDA_ENV}=1 needs torch, which does not import here "
            f"({exc}): {_fix()}"
        ) from None
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
        raise CudaUnavailable(
            f"RuntimeError: {CUDA_ENV}=1 needs a CUDA device, and torch {torch.__version__} "
            f"sees none (CUDA_VISIBLE_DEVICES={visible}; a CPU-only torch sees none either): "
            f"{_fix()}"
        )
    return torch


class CudaHolder:
    """A holder whose device bytes are also real CUDA memory, allocated through `torch` in
    this process, beside the `inner` holder's claims (a claim file, or nothing).

    The memory is held as a list of byte tensors. A claim that grows adds a tensor of the
    difference; one that shrinks drops tensors from the end, hands the freed blocks back to
    the driver (`empty_cache`, so NVML sees the release, not torch's cache) and allocates what
    it dropped too much. Each change is complete, on the device, when `set` returns."""

    def __init__(self, inner: Holder, torch: Any) -> None:
        self._inner = inner
        self._torch = torch
        self._chunks: list[tuple[Any, int]] = []

    @property
    def held(self) -> int:
        """The device bytes this holder allocated."""
        return sum(size for _, size in self._chunks)

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        self._resize(max(0, gpu_bytes))
        self._inner.set(gpu_bytes, host_bytes)

    def _resize(self, target: int) -> None:
        freed = False
        while self._chunks and self.held > target:
            self._chunks.pop()
            freed = True
        if freed:
            # Before any new allocation: one could split a freed block that empty_cache then
            # cannot hand back, and NVML would see more than the claim.
            self._torch.cuda.empty_cache()
        missing = target - self.held
        if missing > 0:
            chunk = self._torch.empty(missing, dtype=self._torch.uint8, device="cuda")
            self._chunks.append((chunk, missing))
        self._torch.cuda.synchronize()

    def close(self) -> None:
        self._chunks.clear()
        self._torch.cuda.empty_cache()
        self._inner.close()


def wrap(holder: Holder, env: Mapping[str, str]) -> Holder:
    """`holder` with real CUDA memory behind it when the environment asks for the CUDA mode;
    CudaUnavailable when it asks and torch cannot serve it."""
    if not wanted(env):
        return holder
    return CudaHolder(holder, load_torch())
