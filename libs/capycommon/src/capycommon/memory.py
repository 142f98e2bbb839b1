"""Memory readings (memwatch) and measured startup peaks."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# A reading older than this is unobserved: it admits nothing.
STALE_AFTER_S = 5.0


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuReading(_Frozen):
    index: int
    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    unified: bool
    # Per process: device bytes by PID.
    processes: dict[int, int] = {}


class HostRam(_Frozen):
    total_bytes: int
    available_bytes: int
    source: Literal["meminfo", "cgroup", "simulated"]


class MemoryReading(_Frozen):
    host: str
    taken_at: float
    backend: Literal["nvml", "simulated", "none"]
    gpus: list[GpuReading]
    ram: HostRam

    def is_fresh(self, now: float) -> bool:
        return now - self.taken_at <= STALE_AFTER_S


class StartupPeak(_Frozen):
    """The most a launch took while starting, device and host apart."""

    deployment: str
    revision: int
    host: str
    fingerprint: str
    device_bytes: int
    host_bytes: int
    provenance: Literal["measured"] = "measured"
    measured_at: float
    samples: int
