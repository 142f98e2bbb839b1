"""Simulated GPU memory held by one engine, per the contract in ARCHITECTURE.md.

When `CAPYCTL_SIMGPU_DIR` is set the engine reads `<dir>/devices.json`, sees the devices that
`CUDA_VISIBLE_DEVICES` names (UUIDs or indexes, in that order; the first is the one a
single-GPU engine uses), and claims memory by writing `<dir>/<pid>.json`
(`capycommon.simgpu`): one file per process, naming its first device, with the bytes it holds
on others (llama.cpp splitting a model) in `also`. Each change lands `lag` seconds after it
was asked for, as freed CUDA memory shows up late in NVML. Without the variable nothing is
accounted. With `ENGINESIM_CUDA=1` each claim is also real device memory, allocated through
torch by the holder (`enginesim.cuda`), with or without the variable.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from capycommon import simgpu
from enginesim import cuda
from enginesim.parallel import split_bytes

if TYPE_CHECKING:
    from enginesim.process import Process

SIMGPU_DIR = "CAPYCTL_SIMGPU_DIR"
GIB = 1 << 30


class NoDevice(Exception):
    """CUDA_VISIBLE_DEVICES names no simulated device."""


@dataclass(frozen=True)
class SimDevice:
    folder: Path
    device: simgpu.Device

    @property
    def total(self) -> int:
        return self.device.total_bytes

    def free_bytes(self, exclude: Collection[int] = ()) -> int:
        """Total minus what live processes (other than `exclude`) claim on this device."""
        found = simgpu.usage(self.folder).get(self.device.uuid)
        claimed = 0
        if found is not None:
            claimed = sum(c.bytes for pid, c in found.by_pid.items() if pid not in exclude)
        return self.device.total_bytes - claimed


def find_devices(env: Mapping[str, str]) -> list[SimDevice] | None:
    """The simulated devices this process sees, in the order CUDA numbers them; None when
    simulation is off. As CUDA reads `CUDA_VISIBLE_DEVICES`, the list ends before the first
    entry that names no device, or one already named; unset, every device is seen."""
    folder = env.get(SIMGPU_DIR)
    if not folder:
        return None
    try:
        devices = simgpu.read_devices(Path(folder))
    except (OSError, ValueError):
        raise NoDevice(f"no readable devices.json in {folder}") from None
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        if not devices:
            raise NoDevice("devices.json lists no device")
        return [SimDevice(Path(folder), device) for device in devices]
    seen: list[simgpu.Device] = []
    for wanted in (part.strip() for part in visible.split(",")):
        found = [device for device in devices if wanted in (device.uuid, str(device.index))]
        if not found or found[0] in seen:
            break
        seen.append(found[0])
    if not seen:
        raise NoDevice(f"CUDA_VISIBLE_DEVICES={visible!r} names no simulated device")
    return [SimDevice(Path(folder), device) for device in seen]


def find_device(env: Mapping[str, str]) -> SimDevice | None:
    """The first simulated device this process sees (a single-GPU engine's); None when
    simulation is off."""
    devices = find_devices(env)
    return None if devices is None else devices[0]


def visible_count(env: Mapping[str, str], devices: Sequence[SimDevice] | None) -> int | None:
    """How many devices the engine sees: the simulated ones, else the entries of
    `CUDA_VISIBLE_DEVICES`; None when neither says (nothing to check against)."""
    if devices is not None:
        return len(devices)
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return len([part for part in visible.split(",") if part.strip()])


def cuda_devices(process: Process) -> list[SimDevice] | None:
    """The devices as torch finds them in vLLM and SGLang: none visible is a crash at start,
    as is the CUDA mode without torch (`enginesim.cuda`)."""
    refused = cuda.refusal(os.environ)
    if refused is not None:
        process.die(refused)
    try:
        return find_devices(os.environ)
    except NoDevice as exc:
        process.die(f"RuntimeError: No CUDA GPUs are available ({exc})")


def cuda_device(process: Process) -> SimDevice | None:
    """The first of `cuda_devices`: a single-GPU engine's device."""
    devices = cuda_devices(process)
    return None if devices is None else devices[0]


def gib(size: int) -> str:
    return f"{size / GIB:.2f}"


class Holder(Protocol):
    """Who holds the engine's device memory: an allocation is claimed when `set` returns, a
    release lands after the lag; changes apply in order."""

    def set(self, gpu_bytes: int, host_bytes: int) -> None: ...

    def close(self) -> None: ...


class NoHolder:
    """Simulation is off: nothing to account."""

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class Spread:
    """How one process's device bytes lie over several devices (llama.cpp splitting a
    model's layers by `--tensor-split`): each device takes its proportion of them. The claim
    names the first device and lists the others' shares in `also`."""

    devices: tuple[SimDevice, ...]
    proportions: tuple[float, ...]

    @classmethod
    def one(cls, device: SimDevice) -> Spread:
        return cls((device,), (1.0,))

    def claim(self, gpu_bytes: int, host_bytes: int) -> simgpu.Claim:
        shares = split_bytes(gpu_bytes, self.proportions)
        also = {d.device.uuid: share for d, share in zip(self.devices[1:], shares[1:], strict=True)}
        first = self.devices[0].device.uuid
        return simgpu.Claim(uuid=first, bytes=shares[0], host_bytes=host_bytes, also=also)


class LocalHolder:
    """This process's claim file. An allocation is written before `set` returns; a release
    is written by a thread once its lag passed, unless a later allocation overtook it. With a
    `spread` the bytes lie over its devices (`device` is then its first)."""

    def __init__(
        self, device: SimDevice, lag: float, pid: int | None = None, spread: Spread | None = None
    ) -> None:
        self._device = device
        self._spread = spread or Spread.one(device)
        self._pid = os.getpid() if pid is None else pid
        self._lag = lag
        self._requested = 0
        self._asked = 0  # changes asked for, in order
        self._written = 0  # the latest change written
        self._changes: queue.Queue[tuple[int, float, int, int] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._apply, name="simgpu", daemon=True).start()

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        # An allocation is there when the call returns; a release shows up late, as freed
        # memory does in NVML.
        releases = gpu_bytes < self._requested and self._lag > 0
        self._requested = gpu_bytes
        with self._lock:
            self._asked += 1
            if not releases:
                self._write(self._asked, gpu_bytes, host_bytes)
                return
            self._changes.put((self._asked, time.monotonic() + self._lag, gpu_bytes, host_bytes))

    def _apply(self) -> None:
        while (change := self._changes.get()) is not None:
            order, due, gpu_bytes, host_bytes = change
            if self._closed.wait(max(0.0, due - time.monotonic())):
                return
            with self._lock:
                self._write(order, gpu_bytes, host_bytes)

    def _write(self, order: int, gpu_bytes: int, host_bytes: int) -> None:
        """Under the lock: the claim, unless closed or a later change is already written."""
        if self._closed.is_set() or order < self._written:
            return
        self._written = order
        claim = self._spread.claim(gpu_bytes, host_bytes)
        simgpu.write_claim(self._device.folder, self._pid, claim)

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            simgpu.remove_claim(self._device.folder, self._pid)
        self._changes.put(None)


def with_cuda(
    process: Process, holder: Holder, placed: Sequence[tuple[int, float]] | None = None
) -> Holder:
    """`holder` with real device memory behind it in the CUDA mode (`enginesim.cuda`), on the
    torch devices `placed` names by index and proportion (by default torch's current one); a
    torch that cannot serve it is a crash at start, naming the fix."""
    try:
        return cuda.wrap(holder, os.environ, placed)
    except cuda.CudaUnavailable as exc:
        holder.close()
        process.die(str(exc))
