"""The regions of device memory an engine holds, and how sleep and wake move them.

A region is on the device, copied to host RAM (vLLM level 1, SGLang with a CPU backup of the
weights), or gone (discarded; its contents must be reloaded). While any region is off the
device the engine still holds `residue` bytes (CUDA context, allocator pools). With the
`sleep_keeps_memory` fault the claim never shrinks, whatever the engine reports.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from enginesim.behaviour import Behaviour
from enginesim.gpu import Holder
from enginesim.process import Process

Place = Literal["gpu", "host", "gone"]
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".gguf"})


def weight_bytes(model: Path) -> int:
    """The model's weights: a file's size, or the weight files' sizes in a folder (st_size,
    so sparse files stand in for big models). A path that does not exist weighs nothing."""
    if model.is_file():
        return model.stat().st_size
    if not model.is_dir():
        return 0
    files = (f for f in model.rglob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file())
    return sum(f.stat().st_size for f in files)


class Regions:
    def __init__(
        self, holder: Holder, sizes: dict[str, int], residue: int, keeps_memory: bool
    ) -> None:
        self.holder = holder
        self.sizes = dict(sizes)
        self.residue = residue
        self.keeps_memory = keeps_memory
        self.place: dict[str, Place] = dict.fromkeys(sizes, "gpu")

    @classmethod
    def of(cls, holder: Holder, sizes: dict[str, int], behaviour: Behaviour) -> Regions:
        """The regions as the behaviour has them: its residue, its `sleep_keeps_memory`."""
        return cls(holder, sizes, behaviour.residue_bytes, behaviour.faults.sleep_keeps_memory)

    @property
    def full(self) -> int:
        return sum(self.sizes.values())

    def loading(self, loaded: int) -> None:
        """Only `loaded` bytes so far (weights first, then the rest at the end of loading)."""
        self.holder.set(loaded, 0)

    def publish(self) -> None:
        if self.keeps_memory:
            self.holder.set(self.full, 0)
            return
        on_gpu = sum(size for name, size in self.sizes.items() if self.place[name] == "gpu")
        on_host = sum(size for name, size in self.sizes.items() if self.place[name] == "host")
        if any(place != "gpu" for place in self.place.values()):
            on_gpu += self.residue
        self.holder.set(on_gpu, on_host)

    def release(self, names: Iterable[str], to_host: Iterable[str] = ()) -> None:
        keep = set(to_host)
        for name in names:
            if self.place.get(name) == "gpu":
                self.place[name] = "host" if name in keep else "gone"
        self.publish()

    def restore(self, names: Iterable[str]) -> None:
        for name in names:
            if name in self.place:
                self.place[name] = "gpu"
        self.publish()

    def off_device(self) -> list[str]:
        return [name for name, place in self.place.items() if place != "gpu"]

    def is_gone(self, name: str) -> bool:
        return self.place.get(name) == "gone"


async def finish_loading(process: Process, behaviour: Behaviour, regions: Regions) -> bool:
    """Every family's end of loading: the load's time, then the `crash_at_start` fault, or
    every region on the device. False when told to stop while loading."""
    if await process.pause(behaviour.load_seconds):
        return False
    crash = behaviour.faults.crash_at_start
    if crash is not None:
        process.die(crash.message, crash.exit_code)
    regions.publish()
    return True
