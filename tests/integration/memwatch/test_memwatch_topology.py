"""How the NVML backend names the links between GPUs: over a stand-in pynvml module here,
over the real driver on a GPU."""

from __future__ import annotations

import logging

import pynvml  # type: ignore[import-untyped]
import pytest

from capycommon.domain.memory import Link
from capyctl_memwatch.hostram import HostRamReader
from capyctl_memwatch.nvml import NvmlBackend, level_link
from integration.memwatch.fakenvml import FakeDevice, FakeNvml

A, B, C, D = (f"GPU-{n}0000000-0000-0000-0000-000000000000" for n in range(1, 5))
SWITCH = "00000000:C1:00.0"  # an NVSwitch's bus ID: NVLinks that end there lead to no GPU


def card(uuid: str, bus_id: str | bytes, nvlinks: list[str | None] | None = None) -> FakeDevice:
    return FakeDevice(name="NVIDIA H100 80GB HBM3", uuid=uuid, bus_id=bus_id, nvlinks=nvlinks)


def open_fake(nvml: FakeNvml) -> NvmlBackend:
    backend = NvmlBackend.open(HostRamReader(), nvml)
    assert backend is not None
    return backend


def published(backend: NvmlBackend) -> dict[str, dict[str, Link]]:
    return {gpu.uuid: gpu.links for gpu in backend.read().gpus}


@pytest.mark.parametrize(
    ("level", "link"),
    [
        (pynvml.NVML_TOPOLOGY_INTERNAL, "switch"),
        (pynvml.NVML_TOPOLOGY_SINGLE, "switch"),
        (pynvml.NVML_TOPOLOGY_MULTIPLE, "switch"),
        (pynvml.NVML_TOPOLOGY_HOSTBRIDGE, "hostbridge"),
        (pynvml.NVML_TOPOLOGY_NODE, "node"),
        (pynvml.NVML_TOPOLOGY_CPU, "node"),
        (pynvml.NVML_TOPOLOGY_SYSTEM, "system"),
        (60, None),
    ],
)
def test_nvml_topology_levels_map_to_links(level: int, link: Link | None) -> None:
    assert level_link(level) == link


def test_nvlink_bridges_and_pcie_levels_are_read_once_at_start() -> None:
    nvml = FakeNvml(
        [
            # A's second and third links lead to B; NVML spells B's domain with 4 digits there.
            card(A, "00000000:07:00.0", [None, "0000:0A:00.0", "0000:0a:00.0"]),
            card(B, "00000000:0A:00.0", ["00000000:07:00.0"]),
            card(C, b"00000000:41:00.0"),  # no NVLink; old bindings answer bytes
            card(D, "00000000:C1:00.0", [None, None]),  # NVLink, none of it active
        ],
        levels={(0, 1): 50, (0, 2): 10, (0, 3): 30, (1, 2): 40, (1, 3): 50, (2, 3): 20},
    )
    backend = open_fake(nvml)
    expected: dict[str, dict[str, Link]] = {
        A: {B: "nvlink", C: "switch", D: "hostbridge"},
        B: {A: "nvlink", C: "node", D: "system"},
        C: {A: "switch", B: "node", D: "switch"},
        D: {A: "hostbridge", B: "system", C: "switch"},
    }
    assert backend.links == expected, "NVLink wins over the PCIe level (A-B: across sockets)"
    asked = nvml.topology_calls
    assert published(backend) == expected
    assert published(backend) == expected
    assert nvml.topology_calls == asked, "a reading asks NVML nothing about the topology"


def test_gpus_joined_through_an_nvswitch_are_nvlinked() -> None:
    nvml = FakeNvml(
        [
            card(A, "00000000:07:00.0", [SWITCH, SWITCH]),
            card(B, "00000000:0A:00.0", [SWITCH, None]),
            card(C, "00000000:41:00.0", [SWITCH]),
            card(D, "00000000:44:00.0"),
        ],
        levels={(0, 1): 40, (0, 2): 40, (1, 2): 40, (0, 3): 50, (1, 3): 50, (2, 3): 20},
        fabric=frozenset({0, 1, 2}),
    )
    assert published(open_fake(nvml)) == {
        A: {B: "nvlink", C: "nvlink", D: "system"},
        B: {A: "nvlink", C: "nvlink", D: "system"},
        C: {A: "nvlink", B: "nvlink", D: "switch"},
        D: {A: "system", B: "system", C: "switch"},
    }


def test_pairs_nvml_cannot_answer_are_left_out_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = FakeNvml(
        [
            card(A, "00000000:07:00.0"),
            card(B, "00000000:0A:00.0"),
            card(C, "00000000:41:00.0"),
            card(D, ""),  # lost: its PCI info raises, so none of its pairs is known
        ],
        levels={(0, 1): 30, (0, 2): 45, (0, 3): 10, (1, 3): 10, (2, 3): 10},  # B-C raises
    )
    with caplog.at_level(logging.INFO, logger="capyctl_memwatch.nvml"):
        backend = open_fake(nvml)
    assert published(backend) == {
        A: {B: "hostbridge"},  # A-C: a level NVML may add later is unknown too
        B: {A: "hostbridge"},
        C: {},
        D: {},
    }
    warned = [r for r in caplog.records if r.getMessage() == "GPU topology partly unknown"]
    assert len(warned) == 1
    fields = warned[0].__dict__
    assert fields["pairs"] == 5
    assert sorted(fields["why"]) == ["0-2", "0-3", "1-2", "1-3", "2-3"]
    assert backend.read().gpus[3].uuid == D, "the GPUs are still read"


def test_one_gpu_has_no_links_and_nvml_is_not_asked() -> None:
    nvml = FakeNvml([card(A, "00000000:07:00.0", [SWITCH])])
    backend = open_fake(nvml)
    assert published(backend) == {A: {}}
    assert nvml.topology_calls == 0
