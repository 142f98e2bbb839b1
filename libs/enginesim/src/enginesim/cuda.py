"""Real device memory behind the simulator's claims: the CUDA mode, `ENGINESIM_CUDA=1`.

With `ENGINESIM_CUDA=1` in the engine's environment, every claim the simulated engine makes on
its device is also made as a real CUDA allocation through torch, in the process that holds the
claim (vLLM's EngineCore child; the SGLang and llama-server process itself), resized when the
claim changes and freed when it shrinks (a park) or the engine stops. NVML, and so memwatch,
nvidia-smi and everything above them, then see the engine's memory as they see a real
engine's: credited to the engine's processes, with the real CUDA context on top and the real
delay before a release shows. `scripts/gpu-check` runs the product on a real GPU this way.

A tensor-parallel rank (vLLM's `VLLM::Worker_TP<i>`, SGLang's `sglang::scheduler_TP<i>`)
allocates on torch device i of the visible ones, as the real rank does after
`torch.cuda.set_device(i)`; llama.cpp splitting a model over several devices allocates each
device's share on that device. A process that names no device allocates on torch's current
one, as before.

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

import contextlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from enginesim.parallel import split_bytes

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


class DeviceBytes:
    """Real memory on one torch device (`index`; None: the current device), held as a list
    of byte tensors. Growing adds a tensor of the difference; shrinking drops tensors from the
    end, hands the freed blocks back to the driver (`empty_cache`, so NVML sees the release,
    not torch's cache) and allocates what it dropped too much. Each change is complete, on
    the device, when `resize` returns."""

    def __init__(self, torch: Any, index: int | None) -> None:
        self._torch = torch
        self._index = index
        self._device = "cuda" if index is None else f"cuda:{index}"
        self._chunks: list[tuple[Any, int]] = []

    @property
    def held(self) -> int:
        return sum(size for _, size in self._chunks)

    @contextlib.contextmanager
    def _current(self) -> Iterator[None]:
        """This device as torch's current one, for `empty_cache` and `synchronize`."""
        if self._index is None:
            yield
            return
        with self._torch.cuda.device(self._index):
            yield

    def resize(self, target: int) -> None:
        with self._current():
            freed = False
            while self._chunks and self.held > target:
                self._chunks.pop()
                freed = True
            if freed:
                # Before any new allocation: one could split a freed block that empty_cache
                # then cannot hand back, and NVML would see more than the claim.
                self._torch.cuda.empty_cache()
            missing = target - self.held
            if missing > 0:
                chunk = self._torch.empty(missing, dtype=self._torch.uint8, device=self._device)
                self._chunks.append((chunk, missing))
            self._torch.cuda.synchronize()

    def clear(self) -> None:
        with self._current():
            self._chunks.clear()
            self._torch.cuda.empty_cache()


class CudaHolder:
    """A holder whose device bytes are also real CUDA memory, allocated through `torch` in
    this process, beside the `inner` holder's claims (a claim file, or nothing): all on the
    current device, or split over the torch devices `placed` names by index and proportion.
    Each change is complete, on every device, when `set` returns."""

    def __init__(
        self, inner: Holder, torch: Any, placed: Sequence[tuple[int, float]] | None = None
    ) -> None:
        self._inner = inner
        if placed is None:
            self._places = [DeviceBytes(torch, None)]
            self._proportions: list[float] = [1.0]
        else:
            self._places = [DeviceBytes(torch, index) for index, _ in placed]
            self._proportions = [proportion for _, proportion in placed]

    @property
    def held(self) -> int:
        """The device bytes this holder allocated, over all its devices."""
        return sum(place.held for place in self._places)

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        shares = split_bytes(max(0, gpu_bytes), self._proportions)
        for place, share in zip(self._places, shares, strict=True):
            place.resize(share)
        self._inner.set(gpu_bytes, host_bytes)

    def close(self) -> None:
        for place in self._places:
            place.clear()
        self._inner.close()


def _check_indexes(torch: Any, placed: Sequence[tuple[int, float]], env: Mapping[str, str]) -> None:
    """CudaUnavailable when torch sees fewer devices than `placed` names."""
    count = int(torch.cuda.device_count())
    wanted = max(index for index, _ in placed)
    if wanted >= count:
        visible = env.get("CUDA_VISIBLE_DEVICES", "(unset)")
        raise CudaUnavailable(
            f"RuntimeError: {CUDA_ENV}=1 needs CUDA device {wanted}, and torch sees {count} "
            f"(CUDA_VISIBLE_DEVICES={visible}): make one device visible per rank, or unset "
            f"{CUDA_ENV}"
        )


def wrap(
    holder: Holder, env: Mapping[str, str], placed: Sequence[tuple[int, float]] | None = None
) -> Holder:
    """`holder` with real CUDA memory behind it when the environment asks for the CUDA mode,
    on the devices `placed` names (by default torch's current one); CudaUnavailable when it
    asks and torch cannot serve it."""
    if not wanted(env):
        return holder
    torch = load_torch()
    if placed:
        _check_indexes(torch, placed, env)
    return CudaHolder(holder, torch, placed or None)
