"""A child process that holds device memory on command, for the attribution step.

Run as `python -c <this file's source> BACKEND BYTES [DIR UUID]` by an interpreter that has
the backend, with CUDA_VISIBLE_DEVICES naming the GPU; it imports nothing of CapyCTL's but
for the simulated backend. Backends:

- `torch`: a byte tensor, freed back to the driver (`empty_cache`) so NVML sees the release;
- `driver`: CUDA's driver API through ctypes on `libcuda.so.1`, which every NVIDIA driver
  installs (no toolkit, no torch): the primary context, `cuMemAlloc`, `cuMemFree`;
- `simulated`: a claim file in a simulated GPU's folder (`capycommon.simgpu`), with a stand-in
  context of CONTEXT_BYTES; for the check's own tests.

It prints `ready <t>` once its CUDA context exists, then answers each line of stdin: `alloc`
with `held <t>` once BYTES are allocated, `free` with `freed <t>` once they are released;
`<t>` is `time.monotonic()` (CLOCK_MONOTONIC, the clock of memwatch's observer too). Any
failure prints `error <what>` and exits 1. The end of stdin ends it.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

CONTEXT_BYTES = 500 << 20


class Memory(Protocol):
    def alloc(self, size: int) -> None: ...

    def free(self) -> None: ...

    def close(self) -> None: ...


class TorchMemory:
    def __init__(self) -> None:
        self.torch: Any = importlib.import_module("torch")
        self.torch.cuda.init()
        self.torch.cuda.synchronize()  # the context exists once a synchronize returns
        self.tensor: Any = None

    def alloc(self, size: int) -> None:
        self.tensor = self.torch.empty(size, dtype=self.torch.uint8, device="cuda")
        self.torch.cuda.synchronize()

    def free(self) -> None:
        self.tensor = None
        self.torch.cuda.empty_cache()
        self.torch.cuda.synchronize()

    def close(self) -> None:
        self.free()


class DriverMemory:
    def __init__(self) -> None:
        self.cuda = ctypes.CDLL("libcuda.so.1")
        self._call("cuInit", 0)
        device = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(device), 0)
        self.context = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self.context), device)
        self._call("cuCtxSetCurrent", self.context)
        self.pointer = ctypes.c_uint64(0)

    def _call(self, name: str, *args: object) -> None:
        result = getattr(self.cuda, name)(*args)
        if result != 0:
            text = ctypes.c_char_p()
            self.cuda.cuGetErrorName(result, ctypes.byref(text))
            raise RuntimeError(f"{name}: {(text.value or b'').decode() or result}")

    def alloc(self, size: int) -> None:
        self._call("cuMemAlloc_v2", ctypes.byref(self.pointer), ctypes.c_size_t(size))
        self._call("cuCtxSynchronize")

    def free(self) -> None:
        if self.pointer.value:
            self._call("cuMemFree_v2", self.pointer)
            self.pointer = ctypes.c_uint64(0)
        self._call("cuCtxSynchronize")

    def close(self) -> None:
        self.free()


class SimulatedMemory:
    def __init__(self, folder: str, uuid: str) -> None:
        self.simgpu: Any = importlib.import_module("capycommon.simgpu")
        self.folder, self.uuid = Path(folder), uuid
        self._claim(CONTEXT_BYTES)

    def _claim(self, size: int) -> None:
        claim = self.simgpu.Claim(uuid=self.uuid, bytes=size)
        self.simgpu.write_claim(self.folder, os.getpid(), claim)

    def alloc(self, size: int) -> None:
        self._claim(CONTEXT_BYTES + size)

    def free(self) -> None:
        self._claim(CONTEXT_BYTES)

    def close(self) -> None:
        self.simgpu.remove_claim(self.folder, os.getpid())


def open_memory(backend: str, rest: Sequence[str]) -> Memory:
    if backend == "torch":
        return TorchMemory()
    if backend == "driver":
        return DriverMemory()
    if backend == "simulated":
        return SimulatedMemory(rest[0], rest[1])
    raise ValueError(f"no backend {backend!r}")


def say(line: str) -> None:
    """One line of the protocol to the parent on stdout, flushed (this program runs apart
    from the CLI, so its lines are its own, not the CLI's output)."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def main(argv: Sequence[str]) -> int:
    backend, size = argv[0], int(argv[1])
    try:
        memory = open_memory(backend, argv[2:])
        say(f"ready {time.monotonic()}")
        for line in sys.stdin:
            if line.strip() == "alloc":
                memory.alloc(size)
                say(f"held {time.monotonic()}")
            elif line.strip() == "free":
                memory.free()
                say(f"freed {time.monotonic()}")
        memory.close()
    except Exception as exc:  # the parent reads what went wrong on the line it waits for
        say(f"error {type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
