"""Fixtures for the engine simulator's tests: installs (made once), simulated GPUs, launches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.simulator.helpers import (
    GIB,
    Engines,
    Installs,
    Launcher,
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


@pytest.fixture
def gpu(tmp_path: Path) -> SimGpu:
    return make_simgpu(tmp_path / "simgpu")


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
