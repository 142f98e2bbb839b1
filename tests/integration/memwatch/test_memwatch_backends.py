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
    assert seen.held_by([os.getpid(), waiting.pid]) == {GPU0: 5 * GIB}
    assert seen.held_by([waiting.pid]) == {GPU0: 2 * GIB}
    assert seen.held_by([dead_pid()]) == {}


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


def test_the_meter_measures_a_real_process_group_per_device(tmp_path: Path) -> None:
    backend = SimulatedBackend.start(tmp_path, "gpu0:24GiB,gpu1:24GiB", HostRamReader(), "64GiB")
    with Claimer(tmp_path) as engine:
        # A worker process on each GPU: the group holds 4 GiB on one, 3 GiB on the other.
        engine.claim(GPU0, 4 * GIB, 2 * GIB)
        engine.child(GPU1, 3 * GIB, GIB)
        assert len(engine.pids()) == 2
        use = GroupMeter(backend.read).measure([engine.pid])[engine.pid]
        assert (use.device_bytes, use.devices) == (4 * GIB, 2), "the fuller GPU, not the sum"
        assert (use.host_bytes, use.pids) == (3 * GIB, 2)
        # Without simulated host RAM, the group's host bytes are its resident memory.
        real = SimulatedBackend.start(tmp_path, "gpu0:24GiB,gpu1:24GiB", HostRamReader())
        use = GroupMeter(real.read).measure([engine.pid])[engine.pid]
        assert use.device_bytes == 4 * GIB
        expected = sum(rss_bytes(pid) for pid in engine.pids())
        assert use.host_bytes > 0
        assert abs(use.host_bytes - expected) < 64 << 20
    assert GroupMeter(backend.read).measure([]) == {}


def test_one_process_on_two_devices_counts_its_fuller_device(tmp_path: Path) -> None:
    backend = SimulatedBackend.start(tmp_path, "gpu0:24GiB,gpu1:24GiB", HostRamReader(), "64GiB")
    meter = GroupMeter(backend.read)
    with Claimer(tmp_path) as engine:
        # One process with a model's layers split over both GPUs, as llama.cpp does.
        split = simgpu.Claim(uuid=GPU0, bytes=5 * GIB, host_bytes=GIB, also={GPU1: 7 * GIB})
        simgpu.write_claim(tmp_path, engine.pid, split)
        gpu0, gpu1 = backend.read().gpus
        assert (gpu0.processes, gpu1.processes) == ({engine.pid: 5 * GIB}, {engine.pid: 7 * GIB})
        use = meter.measure([engine.pid])[engine.pid]
        assert (use.device_bytes, use.devices, use.host_bytes, use.pids) == (7 * GIB, 2, GIB, 1)
        # On one GPU the figure is what the group holds there, as before.
        simgpu.write_claim(tmp_path, engine.pid, simgpu.Claim(uuid=GPU1, bytes=2 * GIB))
        engine.child(GPU1, 3 * GIB, 0)
        use = meter.measure([engine.pid])[engine.pid]
        assert (use.device_bytes, use.devices, use.pids) == (5 * GIB, 1, 2)


def test_a_group_holding_no_device_memory_holds_zero_on_no_device(tmp_path: Path) -> None:
    backend = SimulatedBackend.start(tmp_path, "gpu0:24GiB", HostRamReader(), "64GiB")
    with Claimer(tmp_path) as engine:
        use = GroupMeter(backend.read).measure([engine.pid])[engine.pid]
        assert (use.device_bytes, use.devices, use.pids) == (0, 0, 1)


def test_simulated_readings_carry_the_links_the_spec_names(tmp_path: Path) -> None:
    spec = "gpu0:24GiB,gpu1:24GiB,gpu2:24GiB;gpu0-gpu1:nvlink,gpu1-gpu2:switch"
    gpu2 = simgpu.device_uuid("gpu2")
    seen = SimulatedBackend.start(tmp_path / "linked", spec, HostRamReader()).read()
    assert [gpu.links for gpu in seen.gpus] == [
        {GPU1: "nvlink", gpu2: "system"},
        {GPU0: "nvlink", gpu2: "switch"},
        {GPU0: "system", GPU1: "switch"},
    ]
    assert [d.links for d in simgpu.read_devices(tmp_path / "linked")] == [
        gpu.links for gpu in seen.gpus
    ], "devices.json says the same"
    # Without a topology after `;`, the links are unknown: empty.
    plain = SimulatedBackend.start(tmp_path / "plain", "gpu0:24GiB,gpu1:24GiB", HostRamReader())
    assert [gpu.links for gpu in plain.read().gpus] == [{}, {}]
