"""Step 1: memwatch's NVML backend credits a child's allocation to the child's PID, and sees
it released, with the lag between the free and the first reading that shows it.

A child process (`allocator`, through torch where an interpreter here has it, else CUDA's
driver API) takes a context on the GPU with the most free memory, then allocates and frees
`size` bytes in ROUNDS rounds. memwatch's readings (every 50 ms) must credit the child's own
PID with its context plus `size` once the allocation returned, and with its context alone
after the free; the lag is from the child's free returning to the first reading that shows
it. A reading that credits someone else (NVML's PIDs come from another PID namespace) or
nobody (per-process figures hidden) fails, saying so: memwatch could not attribute there.
"""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from capycommon.units import format_size
from capyctl_cli.gpucheck.devicewatch import DeviceWatch, Gpu, Reading
from capyctl_cli.gpucheck.machine import TorchSearch
from capyctl_cli.gpucheck.report import Fail, Skip, spread

GiB = 1 << 30
MiB = 1 << 20
ROUNDS = 3
MOST_BYTES = 20 * GiB
CONTEXT_TIMEOUT_S = 120.0  # CUDA's own start, with torch's import: seconds, on a cold machine
SHOW_TIMEOUT_S = 15.0
# What a reading may fall short of the bytes asked for (the context can shrink a little when
# the first allocation moves its pools).
SLACK = 64 * MiB


@dataclass(frozen=True)
class Allocator:
    python: str
    backend: str
    extra: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.backend} on {self.python}"


def choose_allocator(torch: TorchSearch, simulated: Path | None, gpu: Gpu) -> Allocator:
    if simulated is not None:
        return Allocator(sys.executable, "simulated", (str(simulated), gpu.uuid))
    found = torch.with_cuda()
    if found is not None:
        return Allocator(found.python, "torch")
    if ctypes.util.find_library("cuda") is not None:
        return Allocator(sys.executable, "driver")
    raise Skip("nothing here allocates device memory: no torch with CUDA, no libcuda.so.1")


class Child:
    """The allocating child, driven line by line."""

    def __init__(self, allocator: Allocator, size: int, gpu: Gpu) -> None:
        source = resources.files("capyctl_cli.gpucheck").joinpath("allocator.py").read_text()
        argv = [allocator.python, "-c", source, allocator.backend, str(size), *allocator.extra]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid}
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def answer(self, word: str, command: str | None = None) -> float:
        """Send `command` (if any) and read the answer: the child's time of `word`."""
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline().split(maxsplit=1)
        if line[:1] != [word]:
            raise Fail(f"the allocating child said {' '.join(line) or 'nothing'}, not {word}")
        return float(line[1])

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _credited(watch: DeviceWatch, child: Child, at_least: int, since: float) -> Reading:
    """The first reading since `since` that credits the child's PID with `at_least`; else a
    Fail that says whom NVML credits instead."""
    try:
        return watch.wait(
            lambda r: (r.held_by(child.pid) or 0) >= at_least,
            SHOW_TIMEOUT_S,
            f"{format_size(at_least)} held by the child (PID {child.pid})",
            since,
        )
    except Fail as failed:
        last = watch.latest()
        others = {p: b for p, b in last.apart_from(watch.baseline).items() if p != child.pid}
        if any(used >= at_least for used in others.values()):
            raise Fail(
                f"NVML credits PID {sorted(others)} with the allocation, not the child's PID "
                f"{child.pid}: its PIDs come from another PID namespace (a container without "
                "the host's PIDs), so memwatch cannot attribute memory here"
            ) from None
        if not last.pids():
            raise Fail(
                f"{failed}; NVML lists no process at all: per-process figures are hidden "
                "here (a container or driver that does not show them)"
            ) from None
        raise


def _round(watch: DeviceWatch, child: Child, size: int, context: int) -> tuple[int, float]:
    """One allocation and release: the bytes credited, and the release's lag."""
    held_at = child.answer("held", "alloc")
    held = _credited(watch, child, context + size - SLACK, held_at)
    freed_at = child.answer("freed", "free")
    released = watch.wait(
        lambda r: (r.held_by(child.pid) or 0) < context + size // 2,
        SHOW_TIMEOUT_S,
        f"the child's {format_size(size)} released",
        freed_at,
    )
    return (held.held_by(child.pid) or 0) - context, released.at - freed_at


def check(watch: DeviceWatch, torch: TorchSearch, simulated: Path | None) -> str:
    gpu = max(watch.first.gpus, key=lambda g: g.free)
    size = min(MOST_BYTES, gpu.free // 4) // (256 * MiB) * (256 * MiB)
    if size <= 0:
        raise Skip(f"{gpu.describe()} has {format_size(gpu.free)} free: too little to allocate")
    allocator = choose_allocator(torch, simulated, gpu)
    child = Child(allocator, size, gpu)
    try:
        ready_at = child.answer("ready")
        context = _credited(watch, child, 1, ready_at).held_by(child.pid) or 0
        rounds = [_round(watch, child, size, context) for _ in range(ROUNDS)]
    finally:
        child.close()
    watch.wait(lambda r: r.held_by(child.pid) is None, SHOW_TIMEOUT_S, "the child's exit")
    credited = sum(1 for got, _ in rounds if got >= size - SLACK)
    if credited < ROUNDS:
        raise Fail(f"NVML credited {format_size(size)} to the child in {credited}/{ROUNDS} rounds")
    lags = [lag for _, lag in rounds]
    return (
        f"NVML credited {format_size(size)} to the child's PID in {credited}/{ROUNDS} rounds "
        f"and saw each release {spread(lags, 'ms', 1000)} after the free; CUDA context "
        f"{format_size(context)} ({allocator.backend}, {gpu.describe()})"
    )
