"""Memory: memwatch's readings of each host's devices and RAM, the startup peaks it
measured, and the scheduler's summary of what its ledger charges on each GPU."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

# A reading older than this is unobserved: it admits nothing.
STALE_AFTER_S = 5.0

# How two GPUs of a host are connected, tightest first: NVLink; one PCIe switch (NVML's
# SINGLE or MULTIPLE); one PCIe host bridge; one NUMA node; across sockets (SYSTEM).
Link = Literal["nvlink", "switch", "hostbridge", "node", "system"]
LINK_ORDER: tuple[Link, ...] = ("nvlink", "switch", "hostbridge", "node", "system")


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
    # How it connects to each other GPU of the host, by that GPU's UUID; empty where the
    # topology is unknown (no NVML topology, a single GPU).
    links: dict[str, Link] = {}


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
    # The most it held on any one of its GPUs (each GPU of a set is charged that share); its
    # host RAM over all its processes.
    device_bytes: int
    host_bytes: int
    provenance: Literal["measured"] = "measured"
    measured_at: float
    samples: int


# What an instance is charged as: the ledger's phases, an LMCache server kept for a stopped
# instance (`cache`), and an engine no deployment owns (`orphan`, its whole GPU).
ChargePhase = Literal["starting", "ready", "parked", "waking", "cache", "orphan", "unknown"]


class GpuCharges(BaseModel):
    """One GPU of one host (a unified host's one pool is its GPU `unified`), in bytes."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    host: str
    gpu: str
    capacity: int
    managed_limit: int
    reserve: int
    parked_limit: int
    # What admission may still take: the lower of the managed limit and the capacity less
    # the reserve, less every charge (none below zero).
    free: int
    charged: dict[ChargePhase, int]


class GpuMemory(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    gpus: tuple[GpuCharges, ...] = ()
