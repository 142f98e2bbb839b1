"""Memory readings for tests: the idle ones the scheduler's unit tests derive their domains
from, and the ones of engines' processes that hostd judges a release by."""

from __future__ import annotations

from capycommon.domain.memory import GpuReading, HostRam, MemoryReading

GiB = 1 << 30


def idle_reading(*gpus: tuple[int, bool], ram: int = 64 * GiB) -> MemoryReading:
    """A simulated reading of host `local`: idle GPUs of the given (size, unified), in
    order, and `ram` bytes of host RAM, all available."""
    return MemoryReading(
        host="local",
        taken_at=0.0,
        backend="simulated",
        gpus=[
            GpuReading(
                index=index,
                uuid=f"GPU-{index}",
                name=f"gpu{index}",
                total_bytes=size,
                used_bytes=0,
                free_bytes=size,
                unified=unified,
            )
            for index, (size, unified) in enumerate(gpus)
        ],
        ram=HostRam(total_bytes=ram, available_bytes=ram, source="simulated"),
    )


def held_reading(taken_at: float, held: dict[int, dict[int, int]]) -> MemoryReading:
    """An NVML reading of host `h` taken at `taken_at`: the 80 GiB GPUs `GPU-<index>` of
    `held`, each with the bytes its processes hold there (by pid)."""
    gpus = [
        GpuReading(
            index=index,
            uuid=f"GPU-{index}",
            name="NVIDIA H100",
            total_bytes=80 * GiB,
            used_bytes=sum(processes.values()),
            free_bytes=0,
            unified=False,
            processes=processes,
        )
        for index, processes in held.items()
    ]
    ram = HostRam(total_bytes=64 * GiB, available_bytes=64 * GiB, source="meminfo")
    return MemoryReading(host="h", taken_at=taken_at, backend="nvml", gpus=gpus, ram=ram)
