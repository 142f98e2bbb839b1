"""Fixtures for the engine simulator's tests: installs (made once), simulated GPUs, launches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from capycommon import simgpu
from engines.simulator.helpers import (
    GIB,
    Devices,
    Engines,
    Installs,
    Launcher,
    Servers,
    SimGpu,
    make_simgpu,
    sparse_file,
)


@pytest.fixture(scope="session")
def installs(tmp_path_factory: pytest.TempPathFactory) -> Installs:
    return Installs(tmp_path_factory.mktemp("installs"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with 2 GiB of (sparse) weights."""
    folder = tmp_path_factory.mktemp("models") / "tiny-model"
    sparse_file(folder / "model-00001-of-00002.safetensors", GIB)
    sparse_file(folder / "model-00002-of-00002.safetensors", GIB)
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    return folder


@pytest.fixture(scope="session")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sparse_file(tmp_path_factory.mktemp("gguf") / "tiny-Q4_K_M.gguf", GIB)


@pytest.fixture(scope="session")
def servers(
    installs: Installs, model_dir: Path, gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Servers:
    return Servers(installs, model_dir, gguf, tmp_path_factory)


@pytest.fixture
def gpu(tmp_path: Path) -> SimGpu:
    return make_simgpu(tmp_path / "simgpu")


@pytest.fixture
def devices(tmp_path: Path) -> Devices:
    """Four simulated 24 GiB devices."""
    listed = simgpu.parse_devices("gpu0:24GiB,gpu1:24GiB,gpu2:24GiB,gpu3:24GiB")
    folder = tmp_path / "simgpu"
    simgpu.write_devices(folder, listed)
    return Devices(folder, [SimGpu(folder, d.uuid, d.total_bytes) for d in listed])


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launched = Launcher(tmp_path)
    yield launched
    launched.cleanup()


@pytest.fixture
def engines(
    installs: Installs, model_dir: Path, gpu: SimGpu, launcher: Launcher, tmp_path: Path
) -> Engines:
    return Engines(installs, model_dir, gpu, launcher, tmp_path)


@pytest.fixture
def ledger(tmp_path: Path) -> Path:
    """The folder where the stand-in torch writes what each process holds (`<pid>.json`)."""
    folder = tmp_path / "ledger"
    folder.mkdir()
    return folder
