"""A stand-in for the `pynvml` module: the same function names over scripted devices.

It raises pynvml's own error classes. Profiles: a discrete card (v2 memory info, `reserved`
counted in v1 `used`), an old driver (no v2 entry points), a unified GB10-like device
(memory info NotSupported, per-process figures present), and no NVML at all.

Topology: each device has a PCI bus ID and, where it has NVLink, the bus ID each of its links
leads to (None: an inactive link); the common-ancestor level of each pair is scripted by
index, and `fabric` names the devices joined through an NVSwitch (whose links lead to the
switch, not to a GPU). A pair with no scripted level raises, as NVML would on a fault.
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
    bus_id: str | bytes = "00000000:00:00.0"  # empty: the GPU is lost (PCI info raises)
    # Where each NVLink leads (a bus ID; None: inactive); None: no NVLink (NotSupported).
    nvlinks: list[str | None] | None = None


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVMLError_NotSupported = pynvml.NVMLError_NotSupported
    NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
    NVMLError_FunctionNotFound = pynvml.NVMLError_FunctionNotFound
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_NVLINK_MAX_LINKS = pynvml.NVML_NVLINK_MAX_LINKS
    NVML_P2P_CAPS_INDEX_NVLINK = pynvml.NVML_P2P_CAPS_INDEX_NVLINK
    NVML_P2P_STATUS_OK = pynvml.NVML_P2P_STATUS_OK

    def __init__(
        self,
        devices: list[FakeDevice],
        *,
        library: bool = True,
        levels: dict[tuple[int, int], int] | None = None,
        fabric: frozenset[int] = frozenset(),
    ) -> None:
        self.devices = devices
        self.library = library
        self.shut = False
        self.levels = {frozenset(pair): level for pair, level in (levels or {}).items()}
        self.fabric = fabric
        # How many topology calls were made (NVLink state and remotes, PCI info, P2P, levels).
        self.topology_calls = 0

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

    def _link(self, handle: FakeDevice, link: int) -> str | None:
        self.topology_calls += 1
        if handle.nvlinks is None:
            raise pynvml.NVMLError_NotSupported()
        if not 0 <= link < len(handle.nvlinks):
            raise pynvml.NVMLError_InvalidArgument()
        return handle.nvlinks[link]

    def nvmlDeviceGetNvLinkState(self, handle: FakeDevice, link: int) -> int:
        return pynvml.NVML_FEATURE_ENABLED if self._link(handle, link) else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: FakeDevice, link: int) -> Any:
        remote = self._link(handle, link)
        if remote is None:
            raise pynvml.NVMLError_NotSupported()
        return SimpleNamespace(busId=remote)

    def nvmlDeviceGetPciInfo(self, handle: FakeDevice) -> Any:
        self.topology_calls += 1
        if not handle.bus_id:
            raise pynvml.NVMLError_GpuIsLost()
        return SimpleNamespace(busId=handle.bus_id)

    def nvmlDeviceGetP2PStatus(self, first: FakeDevice, second: FakeDevice, index: int) -> int:
        self.topology_calls += 1
        assert index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        pair = {self.devices.index(first), self.devices.index(second)}
        joined = pair <= self.fabric
        return int(pynvml.NVML_P2P_STATUS_OK if joined else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED)

    def nvmlDeviceGetTopologyCommonAncestor(self, first: FakeDevice, second: FakeDevice) -> int:
        self.topology_calls += 1
        pair = frozenset((self.devices.index(first), self.devices.index(second)))
        level = self.levels.get(pair)
        if level is None:
            raise pynvml.NVMLError_Unknown()
        return level
