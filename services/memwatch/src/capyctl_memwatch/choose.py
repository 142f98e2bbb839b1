"""The backend of this memwatch, chosen once at start from the settings."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pynvml  # type: ignore[import-untyped]

from capycommon.hostsettings import HostSection
from capyctl_memwatch.backends import Backend, NoBackend, SimulatedBackend
from capyctl_memwatch.hostram import HostRamReader
from capyctl_memwatch.nvml import NvmlBackend

log = logging.getLogger(__name__)


def simgpu_dir(host: HostSection, state_root: Path) -> Path:
    """`host.simgpu_dir` (CAPYCTL_SIMGPU_DIR), else `<state>/simgpu`."""
    return host.simgpu_dir if host.simgpu_dir is not None else state_root / "simgpu"


def open_backend(
    host: HostSection, state_root: Path, ram: HostRamReader, nvml: Any = pynvml
) -> Backend:
    """Simulated GPUs when configured, else NVML when a GPU answers, else none."""
    if host.simulated_gpus is not None:
        folder = simgpu_dir(host, state_root)
        simulated = SimulatedBackend.start(
            folder, host.simulated_gpus, ram, host.simulated_host_ram
        )
        log.info(
            "simulated GPUs",
            extra={"folder": str(folder), "devices": [d.name for d in simulated.devices]},
        )
        return simulated
    found = NvmlBackend.open(ram, nvml)
    if found is not None:
        return found
    log.info("no GPU: host RAM only")
    return NoBackend(ram)
