"""A stand-in for the `pynvml` module: the same function names over scripted devices.

It raises pynvml's own error classes. Profiles: a discrete card (v2 memory info, `reserved`
counted in v1 `used`), an old driver (no v2 entry points), a unified GB10-like device
(memory info NotSupported, per-process figures present), and no NVML at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml  # type: ignore[import-untyped]

GIB = 1 << 30


@dataclass
class FakeDevice:
    name: str | bytes
    uuid: str | bytes
    total: int = 80 * GIB
    used: int = 0
    reserved: int = GIB // 2
    memory: str = "v2"  # "v2", "v1" (old driver) or "unsupported" (unified)
    compute: list[tuple[int, int | None]] = field(default_factory=list)
    graphics: list[tuple[int, int | None]] | None = field(default_factory=list)


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, devices: list[FakeDevice], *, library: bool = True) -> None:
        self.devices = devices
        self.library = library
        self.shut = False

    def nvmlInit(self) -> None:
        if not self.library:
            raise pynvml.NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeDevice:
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: FakeDevice) -> str | bytes:
        return handle.name

    def nvmlDeviceGetUUID(self, handle: FakeDevice) -> str | bytes:
        return handle.uuid

    def nvmlDeviceGetMemoryInfo(self, handle: FakeDevice, version: int | None = None) -> Any:
        if handle.memory == "unsupported":
            raise pynvml.NVMLError_NotSupported()
        if version is not None:
            if handle.memory == "v1":
                raise pynvml.NVMLError_FunctionNotFound()
            free = handle.total - handle.reserved - handle.used
            return SimpleNamespace(
                version=version,
                total=handle.total,
                reserved=handle.reserved,
                free=free,
                used=handle.used,
            )
        used = handle.used + handle.reserved
        return SimpleNamespace(total=handle.total, free=handle.total - used, used=used)

    def _processes(self, entries: list[tuple[int, int | None]]) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in entries]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeDevice) -> list[Any]:
        if handle.memory == "v1":
            raise pynvml.NVMLLibraryMismatchError("no _v3 on this driver")
        return self._processes(handle.compute)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeDevice) -> list[Any]:
        return self._processes(handle.compute)

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: FakeDevice) -> list[Any]:
        if handle.graphics is None:
            raise pynvml.NVMLError_NotSupported()
        if handle.memory == "v1":
            raise pynvml.NVMLLibraryMismatchError("no _v3 on this driver")
        return self._processes(handle.graphics)

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: FakeDevice) -> list[Any]:
        return self._processes(handle.graphics or [])
