"""`python -m capyctl_memwatch.observe`, memwatch's readings as JSON lines: why there are none
without NVML, and a process's simulated claim credited to its PID on the watcher's clock until
the watcher goes."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capycommon import simgpu
from capyctl_memwatch.nvml import NvmlBackend
from capyctl_memwatch.observe import open_backend, why_no_nvml
from integration.memwatch.fakenvml import GIB, FakeDevice, FakeNvml


def test_without_nvml_the_reason_is_told() -> None:
    assert why_no_nvml(FakeNvml([], library=False)) == (
        "NVML does not start (NVML Shared Library Not Found)"
    )
    assert why_no_nvml(FakeNvml([])) == "NVML sees 0 GPUs"
    assert open_backend(None, FakeNvml([])) == "NVML sees 0 GPUs"
    card = FakeDevice(name="NVIDIA H200", uuid="GPU-1")
    assert isinstance(open_backend(None, FakeNvml([card])), NvmlBackend)


class Observer:
    """The observer as a watcher runs it: its lines read by a thread, taken with deadlines."""

    def __init__(self, folder: Path) -> None:
        argv = [sys.executable, "-m", "capyctl_memwatch.observe", "--interval", "0.02"]
        self.proc = subprocess.Popen(
            [*argv, "--simulated", str(folder), "gpu0:24GiB"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def next(self, timeout: float = 10) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.lines.get(timeout=timeout))
        return found

    def until(self, mine: int | None, timeout: float = 10) -> dict[str, Any]:
        """The first reading that credits this test process with `mine` bytes (None: none)."""
        deadline = time.monotonic() + timeout
        while True:
            reading = self.next(max(0.1, deadline - time.monotonic()))
            held = reading["gpus"][0]["processes"].get(str(os.getpid()))
            if held == mine:
                return reading
            assert time.monotonic() < deadline, f"no reading with {mine} for this process"


@pytest.fixture
def observer(tmp_path: Path) -> Iterator[Observer]:
    watching = Observer(tmp_path)
    yield watching
    if watching.proc.poll() is None:
        watching.proc.kill()
        watching.proc.wait()
    watching.reader.join(timeout=10)  # it reads to the end of the output, then stops
    for stream in (watching.proc.stdin, watching.proc.stdout):
        if stream is not None:
            stream.close()


def test_readings_credit_a_claim_to_its_pid_until_the_watcher_goes(
    observer: Observer, tmp_path: Path
) -> None:
    began = time.monotonic()
    first = observer.next()
    assert first["backend"] == "simulated"
    (device,) = first["devices"]
    assert (device["name"], device["total_bytes"]) == ("gpu0", 24 * GIB)
    claimed = time.monotonic()
    simgpu.write_claim(tmp_path, os.getpid(), simgpu.Claim(uuid=device["uuid"], bytes=5 * GIB))
    held = observer.until(5 * GIB)
    assert held["gpus"][0]["used_bytes"] == 5 * GIB
    assert began < held["at"] < time.monotonic(), "the watcher's own clock"
    released = time.monotonic()
    simgpu.remove_claim(tmp_path, os.getpid())
    gone = observer.until(None)
    assert gone["at"] > claimed
    assert gone["at"] < released + 5
    assert observer.proc.stdin is not None
    observer.proc.stdin.close()
    assert observer.proc.wait(timeout=10) == 0, "the watcher went: so does the observer"
