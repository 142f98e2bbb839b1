"""`python -m capyctl_memwatch.observe`: this host's GPUs read by memwatch's own backend, one
JSON line per reading, for a tool that watches the device closely (scripts/gpu-check).

The first line says what is read, `{"backend": "nvml", "devices": [...]}`, or why nothing can
be, `{"error": "..."}` (then the exit status is 3). Each reading follows as
`{"at": <seconds>, "gpus": [...]}`, every `--interval` seconds, until stdin ends (the watcher
went) or SIGTERM. `at` is `time.monotonic()` when the reading began: CLOCK_MONOTONIC, the
same clock in every process of the host, so a watcher compares it with its own times. The
GPUs are memwatch's `GpuReading`s, per-process bytes included, exactly as the service reads
them: what this shows is what memwatch sees. `--simulated DIR SPEC` reads simulated GPUs
instead (CAPYCTL_SIMGPU_DIR and CAPYCTL_SIMULATED_GPUS), as tests run it.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

import pynvml  # type: ignore[import-untyped]

from capycommon.errors import DeviceUnobserved
from capyctl_memwatch.backends import Backend, SimulatedBackend
from capyctl_memwatch.hostram import HostRamReader
from capyctl_memwatch.nvml import NvmlBackend

NO_GPU = 3


def why_no_nvml(nvml: Any) -> str:
    """Why NVML gives no backend: its library or driver does not start, or it sees no GPU."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return f"NVML does not start ({exc})"
    try:
        count = nvml.nvmlDeviceGetCount()
    finally:
        nvml.nvmlShutdown()
    return f"NVML sees {count} GPUs"


def open_backend(simulated: Sequence[str] | None, nvml: Any) -> Backend | str:
    """The backend to read, or why there is none."""
    if simulated is not None:
        folder, spec = simulated
        return SimulatedBackend.start(Path(folder), spec, HostRamReader())
    found = NvmlBackend.open(HostRamReader(), nvml)
    return found if found is not None else why_no_nvml(nvml)


def _emit(out: TextIO, document: dict[str, Any]) -> bool:
    """Write one line; False once the watcher is gone."""
    try:
        out.write(json.dumps(document, separators=(",", ":")) + "\n")
        out.flush()
    except BrokenPipeError:
        return False
    return True


def _watcher_gone(watcher: BinaryIO, interval: float) -> bool:
    """Wait up to `interval` seconds; True when the watcher's stream ended meanwhile."""
    ready, _, _ = select.select([watcher], [], [], interval)
    return bool(ready) and not os.read(watcher.fileno(), 4096)


def observe(backend: Backend, interval: float, out: TextIO, watcher: BinaryIO) -> None:
    """A reading every `interval` seconds until `watcher` ends or `out` is closed (a reading
    that fails is written as an `unobserved` line, and the next one tried)."""
    while True:
        at = time.monotonic()
        try:
            gpus = [gpu.model_dump(mode="json") for gpu in backend.read().gpus]
            document: dict[str, Any] = {"at": at, "gpus": gpus}
        except DeviceUnobserved as exc:
            document = {"at": at, "unobserved": exc.message}
        if not _emit(out, document) or _watcher_gone(watcher, interval):
            return


def header(backend: Backend) -> dict[str, Any]:
    """The first line: the backend and its devices, or why they cannot be read."""
    try:
        gpus = backend.read().gpus
    except DeviceUnobserved as exc:
        return {"error": exc.message}
    devices = [gpu.model_dump(mode="json", exclude={"processes"}) for gpu in gpus]
    return {"backend": backend.name, "devices": devices}


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None, nvml: Any = pynvml) -> int:
    parser = argparse.ArgumentParser(prog="python -m capyctl_memwatch.observe")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between readings")
    parser.add_argument("--simulated", nargs=2, metavar=("DIR", "SPEC"))
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)
    backend = open_backend(args.simulated, nvml)
    if isinstance(backend, str):
        _emit(sys.stdout, {"error": backend})
        return NO_GPU
    try:
        first = header(backend)
        if "error" in first:
            _emit(sys.stdout, first)
            return NO_GPU
        if _emit(sys.stdout, first):
            observe(backend, args.interval, sys.stdout, sys.stdin.buffer)
    finally:
        backend.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
