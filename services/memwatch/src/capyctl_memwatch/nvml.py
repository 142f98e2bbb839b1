"""GPUs through NVML (`nvidia-ml-py`, module `pynvml`), mapped by UUID, never by index.

Memory comes from `nvmlDeviceGetMemoryInfo` with the v2 struct (its `used` leaves out the
driver's reserve, as nvidia-smi does), v1 where v2 is missing. A device whose memory info is
NotSupported (GB10, DGX Spark) shares host RAM: its figures are host RAM's. Per-process bytes
come from the compute and graphics process lists; NVML's PIDs are host PIDs.

How each pair of GPUs connects is read once, when the backend opens (the topology does not
change while the machine runs): NVLink where an active NVLink of one leads to the other
(its remote PCI bus ID is the other's), or where NVML says the pair can reach each other over
NVLink (`nvmlDeviceGetP2PStatus`: GPUs joined through an NVSwitch, whose links end at the
switch); otherwise the level of their closest common PCIe ancestor. A pair NVML cannot answer
for is left out (unknown).

The module is injected (`nvml`), so a fake with the same function names can stand in for it.
"""

from __future__ import annotations

import logging
import re
from contextlib import suppress
from dataclasses import dataclass
from itertools import combinations
from typing import Any, Literal

import pynvml  # type: ignore[import-untyped]

from capycommon.domain.memory import LINK_ORDER, GpuReading, HostRam, Link
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
    def __init__(
        self,
        nvml: Any,
        devices: list[NvmlDevice],
        ram: HostRamReader,
        links: dict[str, dict[str, Link]] | None = None,
    ) -> None:
        self._nvml = nvml
        self.devices = devices
        self._ram = ram
        # By UUID: how the GPU connects to each other GPU, by that GPU's UUID.
        self.links = links or {}

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
        return cls(nvml, devices, ram, read_links(nvml, devices))

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
            links=self.links.get(device.uuid, {}),
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


# nvmlDeviceGetTopologyCommonAncestor's levels: on one board (INTERNAL) or behind one or
# more PCIe switches (SINGLE, MULTIPLE), one host bridge, one NUMA node, or across sockets.
_LEVELS: dict[int, Link] = {
    0: "switch",
    10: "switch",
    20: "switch",
    30: "hostbridge",
    40: "node",
    50: "system",
}


def level_link(level: int) -> Link | None:
    """The link for an NVML topology level; None for a level this mapping does not know."""
    return _LEVELS.get(level)


def _bus_id(value: str | bytes) -> str:
    """A PCI bus ID in one spelling (`00000000:07:00.0`): NVML writes the domain with 4 or 8
    hex digits depending on the call."""
    text = _text(value).strip().lower()
    domain, sep, rest = text.partition(":")
    try:
        return f"{int(domain, 16):08x}:{rest}" if sep else text
    except ValueError:
        return text


@dataclass(frozen=True)
class _Ends:
    """One GPU's PCI bus ID, and the bus IDs its active NVLinks lead to."""

    bus_id: str
    remotes: frozenset[str]


def _ends(nvml: Any, handle: Any) -> _Ends:
    """The GPU's bus ID and NVLink remotes; a link without NVLink (NotSupported, or past the
    card's links: InvalidArgument) leads nowhere. Other NVML errors propagate."""
    remotes: set[str] = set()
    for link in range(nvml.NVML_NVLINK_MAX_LINKS):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                continue
            remotes.add(_bus_id(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId))
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
            continue
    return _Ends(_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId), frozenset(remotes))


def _nvlink_reach(nvml: Any, first: Any, second: Any) -> bool:
    """Whether NVML says the two can reach each other over NVLink (through an NVSwitch too)."""
    try:
        status = nvml.nvmlDeviceGetP2PStatus(first, second, nvml.NVML_P2P_CAPS_INDEX_NVLINK)
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
        return False
    return bool(status == nvml.NVML_P2P_STATUS_OK)


def _pair_link(
    nvml: Any, first: NvmlDevice, second: NvmlDevice, ends: _Ends, other: _Ends
) -> Link | None:
    """How two GPUs connect; None when NVML gives a level this mapping does not know."""
    if ends.bus_id in other.remotes or other.bus_id in ends.remotes:
        return "nvlink"
    if ends.remotes and other.remotes and _nvlink_reach(nvml, first.handle, second.handle):
        return "nvlink"
    return level_link(int(nvml.nvmlDeviceGetTopologyCommonAncestor(first.handle, second.handle)))


def _facts(nvml: Any, devices: list[NvmlDevice]) -> dict[str, _Ends | Exception]:
    """Each GPU's bus ID and NVLink remotes by UUID, or the NVML error that hid them."""
    found: dict[str, _Ends | Exception] = {}
    for device in devices:
        try:
            found[device.uuid] = _ends(nvml, device.handle)
        except nvml.NVMLError as exc:
            found[device.uuid] = exc
    return found


def _link_or_why(
    nvml: Any, first: NvmlDevice, second: NvmlDevice, facts: dict[str, _Ends | Exception]
) -> Link | str:
    """How the two GPUs connect, or why NVML cannot say (a text)."""
    one, two = facts[first.uuid], facts[second.uuid]
    if isinstance(one, Exception):
        return str(one)
    if isinstance(two, Exception):
        return str(two)
    try:
        link = _pair_link(nvml, first, second, one, two)
    except nvml.NVMLError as exc:
        return str(exc)
    return "an unknown topology level" if link is None else link


def read_links(nvml: Any, devices: list[NvmlDevice]) -> dict[str, dict[str, Link]]:
    """By UUID: how each GPU connects to each other GPU, by that GPU's UUID. A pair NVML
    cannot answer for is left out, and the pairs left out are logged once, counted; one GPU
    has no links."""
    links: dict[str, dict[str, Link]] = {device.uuid: {} for device in devices}
    if len(devices) < 2:
        return links
    facts = _facts(nvml, devices)
    named: list[str] = []
    unknown: dict[str, str] = {}
    for first, second in combinations(devices, 2):
        pair = f"{first.index}-{second.index}"
        found = _link_or_why(nvml, first, second, facts)
        if found not in LINK_ORDER:
            unknown[pair] = found
            continue
        links[first.uuid][second.uuid] = found
        links[second.uuid][first.uuid] = found
        named.append(f"{pair}:{found}")
    log.info("GPU topology", extra={"links": named})
    if unknown:
        log.warning("GPU topology partly unknown", extra={"pairs": len(unknown), "why": unknown})
    return links
