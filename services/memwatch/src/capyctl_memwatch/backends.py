"""Where GPU figures come from: NVML, simulated GPUs, or none. Chosen once, at start.

Every backend answers `read()` with one `Observation`: the GPUs (per-process device bytes
included) and host RAM. The simulated backend follows the contract in capycommon.simgpu.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from capycommon import simgpu
from capycommon.domain.memory import GpuReading, HostRam
from capycommon.units import parse_size
from capyctl_memwatch.hostram import HostRamReader

log = logging.getLogger(__name__)

BackendName = Literal["nvml", "simulated", "none"]


@dataclass(frozen=True)
class Observation:
    gpus: list[GpuReading]
    ram: HostRam
    # Host bytes by PID when host RAM is simulated (the claims' host_bytes); None: use RSS.
    host_by_pid: dict[int, int] | None = None

    def held_by(self, pids: Collection[int]) -> dict[str, int]:
        """What the processes hold together on each GPU, by UUID; a GPU they hold nothing on
        is left out. Never summed over GPUs: each GPU's memory is its own."""
        found: dict[str, int] = {}
        for gpu in self.gpus:
            held = sum(gpu.processes.get(pid, 0) for pid in pids)
            if held > 0:
                found[gpu.uuid] = held
        return found


class Backend(Protocol):
    @property
    def name(self) -> BackendName: ...

    def read(self) -> Observation: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class NoBackend:
    """No GPU and no simulation: host RAM only."""

    ram: HostRamReader

    @property
    def name(self) -> BackendName:
        return "none"

    def read(self) -> Observation:
        return Observation(gpus=[], ram=self.ram.read())

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class SimulatedBackend:
    """GPUs named by CAPYCTL_SIMULATED_GPUS; used memory is what live processes claim."""

    folder: Path
    devices: list[simgpu.Device]
    ram: HostRamReader
    host_ram_bytes: int | None = None

    @property
    def name(self) -> BackendName:
        return "simulated"

    @classmethod
    def start(
        cls, folder: Path, spec: str, ram: HostRamReader, host_ram: str | None = None
    ) -> SimulatedBackend:
        """Parse the device list and write `<folder>/devices.json` for engine simulators."""
        devices = simgpu.parse_devices(spec)
        simgpu.write_devices(folder, devices)
        total = parse_size(host_ram) if host_ram is not None else None
        return cls(folder, devices, ram, total)

    def read(self) -> Observation:
        usage = simgpu.usage(self.folder)
        gpus = [_simulated_gpu(device, usage.get(device.uuid)) for device in self.devices]
        if self.host_ram_bytes is None:
            return Observation(gpus=gpus, ram=self.ram.read())
        # One claim file per process: its host bytes stand on its first device's claim.
        by_pid: dict[int, int] = {}
        for found in usage.values():
            for pid, claim in found.by_pid.items():
                by_pid[pid] = max(by_pid.get(pid, 0), claim.host_bytes)
        ram = HostRam(
            total_bytes=self.host_ram_bytes,
            available_bytes=max(0, self.host_ram_bytes - sum(by_pid.values())),
            source="simulated",
        )
        return Observation(gpus=gpus, ram=ram, host_by_pid=by_pid)

    def close(self) -> None:
        return None


def _simulated_gpu(device: simgpu.Device, usage: simgpu.Usage | None) -> GpuReading:
    used = usage.used_bytes if usage is not None else 0
    processes = {pid: c.bytes for pid, c in usage.by_pid.items()} if usage is not None else {}
    return GpuReading(
        index=device.index,
        uuid=device.uuid,
        name=device.name,
        total_bytes=device.total_bytes,
        used_bytes=used,
        free_bytes=max(0, device.total_bytes - used),
        unified=device.unified,
        processes=processes,
        links=device.links,
    )
