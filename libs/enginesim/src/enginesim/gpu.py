"""Simulated GPU memory held by one engine, per the contract in ARCHITECTURE.md.

When `CAPYCTL_SIMGPU_DIR` is set the engine reads `<dir>/devices.json`, takes the device that
`CUDA_VISIBLE_DEVICES` names (a UUID, or an index), and claims memory by writing
`<dir>/<pid>.json` (`capycommon.simgpu`). Each change lands `lag` seconds after it was asked
for, as freed CUDA memory shows up late in NVML. Without the variable nothing is accounted.
With `ENGINESIM_CUDA=1` each claim is also real device memory, allocated through torch by the
holder (`enginesim.cuda`), with or without the variable.
"""

from __future__ import annotations

import contextlib
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from capycommon import simgpu
from enginesim import cuda

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


def find_device(env: Mapping[str, str]) -> SimDevice | None:
    """The simulated device this process sees; None when simulation is off."""
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
        return SimDevice(Path(folder), devices[0])
    wanted = visible.split(",")[0].strip()
    for device in devices:
        if wanted in (device.uuid, str(device.index)):
            return SimDevice(Path(folder), device)
    raise NoDevice(f"CUDA_VISIBLE_DEVICES={visible!r} names no simulated device")


def cuda_device(process: Process) -> SimDevice | None:
    """The device as torch finds it in vLLM and SGLang: none visible is a crash at start, as
    is the CUDA mode without torch (`enginesim.cuda`)."""
    refused = cuda.refusal(os.environ)
    if refused is not None:
        process.die(refused)
    try:
        return find_device(os.environ)
    except NoDevice as exc:
        process.die(f"RuntimeError: No CUDA GPUs are available ({exc})")


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


class LocalHolder:
    """This process's claim file. An allocation is written before `set` returns; a release
    is written by a thread once its lag passed, unless a later allocation overtook it."""

    def __init__(self, device: SimDevice, lag: float, pid: int | None = None) -> None:
        self._device = device
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
        claim = simgpu.Claim(uuid=self._device.device.uuid, bytes=gpu_bytes, host_bytes=host_bytes)
        simgpu.write_claim(self._device.folder, self._pid, claim)

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            simgpu.remove_claim(self._device.folder, self._pid)
        self._changes.put(None)


class ChildHolder:
    """vLLM's `EngineCore`: a child process that holds the memory, told what to hold on stdin;
    it answers each line once its claim is made, so an allocation is there when `set` returns.

    SIGTERM of the API server stops it (`close`). SIGKILL of the API server leaves it running
    and holding, as vLLM's EngineCore is left (it shares the process group, so a group kill
    ends it), unless `stay_when_orphaned` is False.
    """

    def __init__(self, device: SimDevice | None, lag: float, stay_when_orphaned: bool) -> None:
        argv = ["VLLM::EngineCore", "-m", "enginesim.enginecore"]
        argv += ["--lag", str(lag), "--orphan", "stay" if stay_when_orphaned else "exit"]
        if device is not None:
            argv += ["--dir", str(device.folder), "--uuid", device.device.uuid]
        # argv[0] is the process title; PYTHONPATH lets that interpreter find our packages.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            argv,
            executable=sys.executable,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def set(self, gpu_bytes: int, host_bytes: int) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        try:
            self.proc.stdin.write(f"{gpu_bytes} {host_bytes}\n".encode())
            self.proc.stdin.flush()
            self.proc.stdout.readline()  # empty when the child is gone
        except (BrokenPipeError, ValueError):
            pass  # the child is gone; the API server notices through `exited`

    def exited(self) -> int | None:
        return self.proc.poll()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def with_cuda(process: Process, holder: Holder) -> Holder:
    """`holder` with real device memory behind it in the CUDA mode (`enginesim.cuda`); a
    torch that cannot serve it is a crash at start, naming the fix."""
    try:
        return cuda.wrap(holder, os.environ)
    except cuda.CudaUnavailable as exc:
        holder.close()
        process.die(str(exc))
