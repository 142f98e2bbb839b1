"""GPUs through NVML (`nvidia-ml-py`, module `pynvml`), mapped by UUID, never by index.

Memory comes from `nvmlDeviceGetMemoryInfo` with the v2 struct (its `used` leaves out the
driver's reserve, as nvidia-smi does), v1 where v2 is missing. A device whose memory info is
NotSupported (GB10, DGX Spark) shares host RAM: its figures are host RAM's. Per-process bytes
come from the compute and graphics process lists; NVML's PIDs are host PIDs.

The module is injected (`nvml`), so a fake with the same function names can stand in for it.
"""

from __future__ import annotations

import logging
import re
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, Literal

import pynvml  # type: ignore[import-untyped]

from capycommon.domain.memory import GpuReading, HostRam
from capycommon.errors import DeviceUnobserved
from capyctl_memwatch.backends import BackendName, Observation
from capyctl_memwatch.hostram import HostRamReader

log = logging.getLogger(__name__)

MemoryMode = Literal["v2", "v1", "unified"]

# GB10 may answer memory info with misleading figures instead of NotSupported.
_UNIFIED_NAMES = re.compile(r"\bGB10\b")


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class NvmlDevice:
    index: int
    handle: Any
    uuid: str
    name: str
    mode: MemoryMode


def memory_mode(nvml: Any, handle: Any, name: str) -> MemoryMode:
    """How to read the device's memory: v2, v1, or from host RAM (unified)."""
    if _UNIFIED_NAMES.search(name):
        return "unified"
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return "v2"
        except nvml.NVMLError:
            pass  # no v2 entry point or struct on this driver: try v1
    try:
        nvml.nvmlDeviceGetMemoryInfo(handle)
    except nvml.NVMLError_NotSupported:
        return "unified"
    return "v1"


def _process_list(nvml: Any, function: str, handle: Any) -> list[Any]:
    """A running-process list, through the versioned fallback on an older driver."""
    try:
        try:
            return list(getattr(nvml, function)(handle))
        except (nvml.NVMLLibraryMismatchError, nvml.NVMLError_FunctionNotFound):
            return list(getattr(nvml, f"{function}_v2")(handle))
    except nvml.NVMLError_NotSupported:
        return []


def process_bytes(nvml: Any, handle: Any) -> dict[int, int]:
    """Device bytes by PID; a PID in both the compute and graphics lists counts once."""
    found: dict[int, int] = {}
    for function in (
        "nvmlDeviceGetComputeRunningProcesses",
        "nvmlDeviceGetGraphicsRunningProcesses",
    ):
        for entry in _process_list(nvml, function, handle):
            if entry.usedGpuMemory is None:  # the driver cannot tell (some containers, WSL)
                continue
            pid = int(entry.pid)
            found[pid] = max(found.get(pid, 0), int(entry.usedGpuMemory))
    return found


class NvmlBackend:
    def __init__(self, nvml: Any, devices: list[NvmlDevice], ram: HostRamReader) -> None:
        self._nvml = nvml
        self.devices = devices
        self._ram = ram

    @property
    def name(self) -> BackendName:
        return "nvml"

    @classmethod
    def open(cls, ram: HostRamReader, nvml: Any = pynvml) -> NvmlBackend | None:
        """The backend over every GPU NVML sees; None when there is no NVML or no GPU."""
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            log.info("no NVML", extra={"reason": str(exc)})
            return None
        try:
            devices = [_probe(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
        except nvml.NVMLError as exc:
            _shutdown(nvml)
            raise DeviceUnobserved(f"NVML could not list the GPUs: {exc}") from None
        if not devices:
            _shutdown(nvml)
            log.info("NVML sees no GPU")
            return None
        log.info(
            "NVML GPUs",
            extra={"devices": [f"{d.index}:{d.name}:{d.uuid}:{d.mode}" for d in devices]},
        )
        return cls(nvml, devices, ram)

    def read(self) -> Observation:
        ram = self._ram.read()
        try:
            gpus = [self._gpu(device, ram) for device in self.devices]
        except self._nvml.NVMLError as exc:
            raise DeviceUnobserved(f"NVML could not read the GPUs: {exc}") from None
        return Observation(gpus=gpus, ram=ram)

    def _gpu(self, device: NvmlDevice, ram: HostRam) -> GpuReading:
        if device.mode == "unified":
            total, free = ram.total_bytes, ram.available_bytes
            used = total - free
        else:
            if device.mode == "v2":
                info = self._nvml.nvmlDeviceGetMemoryInfo(
                    device.handle, version=self._nvml.nvmlMemory_v2
                )
            else:
                info = self._nvml.nvmlDeviceGetMemoryInfo(device.handle)
            total, used, free = int(info.total), int(info.used), int(info.free)
        return GpuReading(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            total_bytes=total,
            used_bytes=used,
            free_bytes=free,
            unified=device.mode == "unified",
            processes=process_bytes(self._nvml, device.handle),
        )

    def close(self) -> None:
        _shutdown(self._nvml)


def _probe(nvml: Any, index: int) -> NvmlDevice:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(nvml.nvmlDeviceGetName(handle))
    uuid = _text(nvml.nvmlDeviceGetUUID(handle))
    return NvmlDevice(index, handle, uuid, name, memory_mode(nvml, handle, name))


def _shutdown(nvml: Any) -> None:
    with suppress(nvml.NVMLError):
        nvml.nvmlShutdown()
