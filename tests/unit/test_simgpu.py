from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from capycommon import simgpu
from capycommon.errors import InvalidConfig
from capycommon.units import format_size, parse_size


def test_sizes() -> None:
    assert parse_size("24GiB") == 24 << 30
    assert parse_size("1.5 GiB") == 3 << 29
    assert parse_size("100B") == 100
    assert format_size(3 << 29) == "1.5 GiB"
    with pytest.raises(ValueError, match="512MiB"):
        parse_size("24GB")


def test_devices_parse_with_stable_uuids() -> None:
    first = simgpu.parse_devices("gpu0:24GiB, gpu1:80GiB")
    assert [(d.index, d.name, d.total_bytes, d.unified) for d in first] == [
        (0, "gpu0", 24 << 30, False),
        (1, "gpu1", 80 << 30, False),
    ]
    assert simgpu.parse_devices("gpu0:8GiB")[0].uuid == first[0].uuid
    assert first[0].uuid.startswith("GPU-")
    assert simgpu.parse_devices("unified:128GiB")[0].unified


@pytest.mark.parametrize("spec", ["", "gpu0", "gpu0:lots", "unified:1GiB,gpu0:1GiB"])
def test_bad_device_lists_are_refused(spec: str) -> None:
    with pytest.raises(InvalidConfig, match="CAPYCTL_SIMULATED_GPUS"):
        simgpu.parse_devices(spec)


def test_usage_counts_live_processes_only(tmp_path: Path) -> None:
    devices = simgpu.parse_devices("gpu0:24GiB")
    simgpu.write_devices(tmp_path, devices)
    assert simgpu.read_devices(tmp_path) == devices
    gpu = devices[0].uuid
    simgpu.write_claim(tmp_path, os.getpid(), simgpu.Claim(uuid=gpu, bytes=5, host_bytes=2))
    gone = subprocess.Popen(["true"])
    gone.wait()
    simgpu.write_claim(tmp_path, gone.pid, simgpu.Claim(uuid=gpu, bytes=100))
    found = simgpu.usage(tmp_path)[gpu]
    assert (found.used_bytes, found.host_bytes) == (5, 2)
    assert list(found.by_pid) == [os.getpid()]
    simgpu.remove_claim(tmp_path, os.getpid())
    assert simgpu.usage(tmp_path) == {}
