"""The simulated and no-GPU backends, and process groups, on real processes and claim files."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from capycommon import simgpu
from capycommon.hostsettings import HostSection
from capyctl_memwatch.backends import NoBackend, SimulatedBackend
from capyctl_memwatch.choose import open_backend, simgpu_dir
from capyctl_memwatch.hostram import HostRamReader
from capyctl_memwatch.procs import GroupMeter, group_members, parse_stat, parse_vmrss, rss_bytes
from integration.memwatch.helpers import GIB, Claimer

GPU0 = simgpu.device_uuid("gpu0")
GPU1 = simgpu.device_uuid("gpu1")


@pytest.fixture
def waiting() -> Iterator[subprocess.Popen[str]]:
    """A live process that only waits for the end of its stdin."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True
    )
    yield proc
    proc.communicate(timeout=10)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_start_writes_devices_json_with_stable_uuids(tmp_path: Path) -> None:
    backend = SimulatedBackend.start(tmp_path / "sim", "gpu0:24GiB,gpu1:8GiB", HostRamReader())
    devices = simgpu.read_devices(tmp_path / "sim")
    assert [(d.index, d.name, d.uuid, d.total_bytes) for d in devices] == [
        (0, "gpu0", GPU0, 24 * GIB),
        (1, "gpu1", GPU1, 8 * GIB),
    ]
    assert backend.devices == devices
    assert backend.name == "simulated"


def test_used_memory_is_the_claims_of_live_processes(
    tmp_path: Path, waiting: subprocess.Popen[str]
) -> None:
    backend = SimulatedBackend.start(tmp_path, "gpu0:24GiB,gpu1:24GiB", HostRamReader(), "64GiB")
    simgpu.write_claim(
        tmp_path, os.getpid(), simgpu.Claim(uuid=GPU0, bytes=3 * GIB, host_bytes=GIB)
    )
    simgpu.write_claim(
        tmp_path, waiting.pid, simgpu.Claim(uuid=GPU0, bytes=2 * GIB, host_bytes=GIB)
    )
    simgpu.write_claim(tmp_path, dead_pid(), simgpu.Claim(uuid=GPU1, bytes=5 * GIB, host_bytes=GIB))
    simgpu.write_claim(tmp_path, waiting.pid + 1_000_000, simgpu.Claim(uuid="GPU-other", bytes=1))
    (tmp_path / ".123.json.tmp").write_text("{half")
    seen = backend.read()
    gpu0, gpu1 = seen.gpus
    assert (gpu0.used_bytes, gpu0.free_bytes, gpu0.total_bytes) == (5 * GIB, 19 * GIB, 24 * GIB)
    assert gpu0.processes == {os.getpid(): 3 * GIB, waiting.pid: 2 * GIB}
    assert (gpu1.used_bytes, gpu1.free_bytes, gpu1.processes) == (0, 24 * GIB, {})
    assert not gpu0.unified
    assert (seen.ram.total_bytes, seen.ram.available_bytes) == (64 * GIB, 62 * GIB)
    assert seen.ram.source == "simulated"
    assert seen.host_by_pid == {os.getpid(): GIB, waiting.pid: GIB}
    assert seen.device_by_pid() == {os.getpid(): 3 * GIB, waiting.pid: 2 * GIB}


def test_without_simulated_host_ram_the_real_host_ram_is_read(tmp_path: Path) -> None:
    backend = SimulatedBackend.start(tmp_path, "unified:128GiB", HostRamReader())
    seen = backend.read()
    assert seen.gpus[0].unified
    assert seen.ram.source in {"meminfo", "cgroup"}
    assert seen.host_by_pid is None


def test_open_backend_follows_the_settings(tmp_path: Path) -> None:
    ram = HostRamReader()
    sim = HostSection(simulated_gpus="gpu0:1GiB", simulated_host_ram="2GiB")
    assert simgpu_dir(sim, tmp_path) == tmp_path / "simgpu"
    chosen = open_backend(sim, tmp_path, ram)
    assert chosen.name == "simulated"
    assert (tmp_path / "simgpu" / "devices.json").is_file()
    elsewhere = HostSection(simulated_gpus="gpu0:1GiB", simgpu_dir=tmp_path / "else")
    open_backend(elsewhere, tmp_path, ram)
    assert (tmp_path / "else" / "devices.json").is_file()


def test_no_gpu_and_no_simulation_reads_host_ram_only() -> None:
    seen = NoBackend(HostRamReader()).read()
    assert seen.gpus == []
    assert seen.ram.total_bytes > 0


def test_stat_and_status_fields() -> None:
    stat = parse_stat("77 (my (odd) name) S 1 77 77 0 -1 4194560 100 0 0 0")
    assert (stat.state, stat.ppid, stat.pgid) == ("S", 1, 77)
    assert parse_vmrss("Name:\tx\nVmRSS:\t  2048 kB\nVmSwap: 0 kB\n") == 2 << 20
    assert parse_vmrss("Name:\tkthreadd\nState:\tS\n") == 0


def test_group_members_from_a_fixture_tree(tmp_path: Path) -> None:
    for pid, state, pgid in [(10, "S", 10), (11, "R", 10), (12, "Z", 10), (13, "S", 20)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (engine) {state} 1 {pgid} {pgid} 0")
        (tmp_path / str(pid) / "status").write_text(f"VmRSS:\t{pid} kB\n")
    (tmp_path / "self").mkdir()
    (tmp_path / "14").mkdir()  # gone while we looked: no stat
    assert group_members([10, 30], tmp_path) == {10: [10, 11], 30: []}
    assert rss_bytes(11, tmp_path) == 11 * 1024
    assert rss_bytes(99, tmp_path) == 0


def test_the_meter_sums_a_real_process_group(tmp_path: Path) -> None:
    backend = SimulatedBackend.start(tmp_path, "gpu0:24GiB,gpu1:24GiB", HostRamReader(), "64GiB")
    with Claimer(tmp_path) as engine:
        engine.claim(GPU0, 4 * GIB, 2 * GIB)
        engine.child(GPU1, 3 * GIB, GIB)
        assert len(engine.pids()) == 2
        use = GroupMeter(backend.read).measure([engine.pid])[engine.pid]
        assert (use.device_bytes, use.host_bytes, use.pids) == (7 * GIB, 3 * GIB, 2)
        # Without simulated host RAM, the group's host bytes are its resident memory.
        real = SimulatedBackend.start(tmp_path, "gpu0:24GiB,gpu1:24GiB", HostRamReader())
        use = GroupMeter(real.read).measure([engine.pid])[engine.pid]
        assert use.device_bytes == 7 * GIB
        expected = sum(rss_bytes(pid) for pid in engine.pids())
        assert use.host_bytes > 0
        assert abs(use.host_bytes - expected) < 64 << 20
    assert GroupMeter(backend.read).measure([]) == {}
