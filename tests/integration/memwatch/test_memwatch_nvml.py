"""The NVML backend: over a stand-in pynvml module here, over the real driver on a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml  # type: ignore[import-untyped]
import pytest

from capycommon.domain.memory import LINK_ORDER
from capycommon.errors import DeviceUnobserved
from capyctl_memwatch.hostram import HostRamReader
from capyctl_memwatch.nvml import NvmlBackend
from gpucheckrun import nvml_here
from integration.memwatch.fakenvml import GIB, FakeDevice, FakeNvml

H100 = "GPU-11111111-2222-3333-4444-555555555555"
SPARK = "GPU-66666666-7777-8888-9999-000000000000"


def open_fake(*devices: FakeDevice) -> tuple[NvmlBackend, FakeNvml]:
    nvml = FakeNvml(list(devices))
    backend = NvmlBackend.open(HostRamReader(), nvml)
    assert backend is not None
    return backend, nvml


def test_a_discrete_card_reads_v2_with_processes_by_pid() -> None:
    card = FakeDevice(
        name="NVIDIA H100 80GB HBM3",
        uuid=H100,
        used=30 * GIB,
        compute=[(101, 20 * GIB), (102, None), (103, 9 * GIB)],
        graphics=[(103, 9 * GIB), (104, GIB)],
    )
    backend, nvml = open_fake(card)
    assert backend.name == "nvml"
    assert [d.mode for d in backend.devices] == ["v2"]
    (gpu,) = backend.read().gpus
    assert (gpu.index, gpu.uuid, gpu.name, gpu.unified) == (0, H100, card.name, False)
    assert (gpu.total_bytes, gpu.used_bytes) == (80 * GIB, 30 * GIB), "v2 used leaves out reserve"
    assert gpu.free_bytes == 80 * GIB - 30 * GIB - GIB // 2
    assert gpu.processes == {101: 20 * GIB, 103: 9 * GIB, 104: GIB}, "unknown use is left out"
    backend.close()
    assert nvml.shut


def test_an_old_driver_falls_back_to_v1_and_v2_process_lists() -> None:
    card = FakeDevice(
        name=b"Tesla V100",
        uuid=H100.encode(),
        used=GIB,
        memory="v1",
        compute=[(7, GIB)],
        graphics=None,
    )
    backend, _ = open_fake(card)
    (gpu,) = backend.read().gpus
    assert (gpu.name, gpu.uuid) == ("Tesla V100", H100), "bytes from old bindings are decoded"
    assert gpu.used_bytes == GIB + GIB // 2, "v1 counts the reserve as used"
    assert gpu.processes == {7: GIB}


@pytest.mark.parametrize(
    ("name", "memory"),
    [("NVIDIA GB10", "unsupported"), ("NVIDIA GB10", "v2"), ("X", "unsupported")],
)
def test_a_unified_device_reads_host_ram(name: str, memory: str) -> None:
    spark = FakeDevice(name=name, uuid=SPARK, memory=memory, compute=[(9, 5 * GIB)])
    backend, _ = open_fake(spark)
    seen = backend.read()
    (gpu,) = seen.gpus
    assert gpu.unified
    assert gpu.total_bytes == seen.ram.total_bytes
    assert gpu.free_bytes == seen.ram.available_bytes
    assert gpu.used_bytes == seen.ram.total_bytes - seen.ram.available_bytes
    assert gpu.processes == {9: 5 * GIB}


def test_no_library_or_no_gpu_means_no_nvml_backend() -> None:
    assert NvmlBackend.open(HostRamReader(), FakeNvml([], library=False)) is None
    empty = FakeNvml([])
    assert NvmlBackend.open(HostRamReader(), empty) is None
    assert empty.shut


def test_a_device_that_fails_mid_run_is_unobserved() -> None:
    card = FakeDevice(name="NVIDIA A100", uuid=H100)
    backend, _ = open_fake(card)
    card.memory = "unsupported"  # v2 now raises, as a lost GPU would
    with pytest.raises(DeviceUnobserved, match="NVML could not read the GPUs"):
        backend.read()


gpu_present = pytest.mark.skipif(
    not nvml_here(), reason="no NVIDIA GPU here: pynvml.nvmlInit() failed (NVML not found)"
)


@pytest.fixture
def real() -> Iterator[NvmlBackend]:
    backend = NvmlBackend.open(HostRamReader())
    assert backend is not None, "nvmlInit succeeded but NVML lists no GPU"
    yield backend
    backend.close()


@gpu_present
def test_real_gpus_are_read_by_uuid(real: NvmlBackend) -> None:
    seen = real.read()
    assert len(seen.gpus) == pynvml.nvmlDeviceGetCount()
    for gpu in seen.gpus:
        assert gpu.uuid.startswith(("GPU-", "MIG-"))
        assert gpu.total_bytes > 0
        assert 0 <= gpu.used_bytes <= gpu.total_bytes
        assert 0 <= gpu.free_bytes <= gpu.total_bytes
        assert all(pid > 0 and used >= 0 for pid, used in gpu.processes.items())


@gpu_present
def test_real_discrete_figures_match_nvml_v2(real: NvmlBackend) -> None:
    for device, gpu in zip(real.devices, real.read().gpus, strict=True):
        if device.mode != "v2":
            continue
        info = pynvml.nvmlDeviceGetMemoryInfo(device.handle, version=pynvml.nvmlMemory_v2)
        assert gpu.total_bytes == info.total
        assert abs(gpu.used_bytes - info.used) < 256 << 20


@gpu_present
def test_real_links_name_the_other_gpus_alike_both_ways(real: NvmlBackend) -> None:
    gpus = real.read().gpus
    uuids = {gpu.uuid for gpu in gpus}
    for gpu in gpus:
        assert set(gpu.links) <= uuids - {gpu.uuid}
        assert all(link in LINK_ORDER for link in gpu.links.values())
        for other, link in gpu.links.items():
            assert next(g for g in gpus if g.uuid == other).links[gpu.uuid] == link
    if len(gpus) == 1:
        assert gpus[0].links == {}
