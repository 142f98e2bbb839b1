"""The GPUs as memwatch reads them, every 50 ms, for the whole check.

memwatch's own backend runs in a process of its own (`python -m capyctl_memwatch.observe`;
the CLI imports no service), writing one JSON line per reading; a thread here keeps them in
order. A step waits for the first reading that shows what it expects, with a deadline, and
reads the times off the readings themselves: they are on CLOCK_MONOTONIC, the clock of the
check and of its allocating child too.

"Ours" is what processes the check started hold: every PID a reading credits that the first
reading did not. NVML's PIDs are the host's, which differ from this process's in a container
with a PID namespace of its own; new PIDs are ours either way (on a GPU others use meanwhile,
theirs would count too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from capycommon.units import format_size
from capyctl_cli.gpucheck.report import Fail, Skip

INTERVAL_S = 0.05
START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    total: int
    used: int
    free: int
    processes: dict[int, int]

    def describe(self) -> str:
        return f"gpu{self.index} {self.name} {format_size(self.total)}"


@dataclass(frozen=True)
class Reading:
    at: float
    gpus: tuple[Gpu, ...]

    def held_by(self, pid: int) -> int | None:
        found = [gpu.processes[pid] for gpu in self.gpus if pid in gpu.processes]
        return sum(found) if found else None

    def pids(self) -> set[int]:
        return {pid for gpu in self.gpus for pid in gpu.processes}

    def apart_from(self, known: set[int]) -> dict[int, int]:
        """Bytes of each PID not in `known`."""
        found: dict[int, int] = {}
        for gpu in self.gpus:
            for pid, used in gpu.processes.items():
                if pid not in known:
                    found[pid] = found.get(pid, 0) + used
        return found

    @property
    def used(self) -> int:
        return sum(gpu.used for gpu in self.gpus)


def _gpu(raw: dict[str, object]) -> Gpu:
    processes = raw.get("processes") or {}
    assert isinstance(processes, dict)
    return Gpu(
        index=int(str(raw["index"])),
        uuid=str(raw["uuid"]),
        name=str(raw["name"]),
        total=int(str(raw["total_bytes"])),
        used=int(str(raw["used_bytes"])),
        free=int(str(raw["free_bytes"])),
        processes={int(pid): int(used) for pid, used in processes.items()},
    )


class DeviceWatch:
    def __init__(self, proc: subprocess.Popen[str], backend: str, first: Reading) -> None:
        self.proc = proc
        self.backend = backend
        self.first = first
        self.baseline = first.pids()
        self._readings = [first]
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="devicewatch", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, simulated: tuple[Path, str] | None = None) -> DeviceWatch:
        """The watch, once its first reading came; Skip when there is no GPU to read."""
        argv = [sys.executable, "-m", "capyctl_memwatch.observe", "--interval", str(INTERVAL_S)]
        if simulated is not None:
            argv += ["--simulated", str(simulated[0]), simulated[1]]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        head = json.loads(proc.stdout.readline() or '{"error": "the observer exited"}')
        if "error" in head:
            _end(proc)
            raise Skip(f"no NVIDIA GPU to read: {head['error']}")
        first = json.loads(proc.stdout.readline() or "{}")
        if "gpus" not in first:
            _end(proc)
            raise Skip(f"memwatch could not read the GPUs: {first.get('unobserved', first)}")
        reading = Reading(float(first["at"]), tuple(_gpu(raw) for raw in first["gpus"]))
        return cls(proc, str(head["backend"]), reading)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            raw = json.loads(line)
            if "gpus" not in raw:
                continue  # unobserved this once: the next reading may be
            reading = Reading(float(raw["at"]), tuple(_gpu(gpu) for gpu in raw["gpus"]))
            with self._changed:
                self._readings.append(reading)
                self._changed.notify_all()

    def latest(self) -> Reading:
        with self._changed:
            return self._readings[-1]

    def since(self, at: float) -> list[Reading]:
        with self._changed:
            return [r for r in self._readings if r.at >= at]

    def ours(self, reading: Reading) -> int:
        return sum(reading.apart_from(self.baseline).values())

    def wait(
        self, shows: Callable[[Reading], bool], timeout: float, what: str, since: float = 0.0
    ) -> Reading:
        """The first reading begun at `since` or later that `shows` what is waited for;
        Fail naming `what` and the last reading when none did within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._changed:
            while True:
                for reading in self._readings[seen:]:
                    if reading.at >= since and shows(reading):
                        return reading
                seen = len(self._readings)
                left = deadline - time.monotonic()
                if left <= 0 or not self._reader.is_alive():
                    last = self._readings[-1]
                    raise Fail(
                        f"no reading showed {what} within {timeout:.0f} s (last: "
                        f"{format_size(last.used)} used, processes {_pids(last)})"
                    )
                self._changed.wait(left)

    def close(self) -> None:
        _end(self.proc)
        self._reader.join(timeout=10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _pids(reading: Reading) -> str:
    held = {pid: format_size(used) for gpu in reading.gpus for pid, used in gpu.processes.items()}
    return str(held) if held else "none"


def _end(proc: subprocess.Popen[str]) -> None:
    """The observer stops when its stdin ends."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
