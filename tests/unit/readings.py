"""The memory readings the scheduler's unit tests derive their domains from."""

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
