"""The hostd tests' fixtures: simulated engine installs, a sparse model, hostd itself."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from enginerun import sparse_model
from enginesim.install import install_python_engine, write_behaviour
from integration.hostd.harness import FAST, GiB, Hostd
from support import group_members, short_dir


@pytest.fixture(scope="session")
def installs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engines")
    return {
        "vllm": install_python_engine(root / "vllm", "vllm", "0.29.0", FAST),
        "sglang": install_python_engine(root / "sglang", "sglang", "0.5.16", FAST),
        "sglang22": install_python_engine(root / "sglang22", "sglang", "0.5.22", FAST),
    }


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sparse_model(tmp_path_factory.mktemp("models") / "tiny", 2 * GiB)


@pytest.fixture
def hostd(redis_socket: Path, installs: dict[str, Path]) -> Iterator[tuple[Hostd, str]]:
    """hostd on a fresh Redis, every install back to the FAST behaviour; the engines it left
    are killed afterwards."""
    for install in installs.values():
        write_behaviour(install, FAST)
    root = short_dir("hostd")
    harness = Hostd(state=root / "state", home=root / "home", redis_socket=redis_socket)
    harness.state.mkdir(mode=0o700, parents=True)
    gpu = harness.prepare(installs)
    harness.start()
    yield harness, gpu
    harness.stop()
    for record_pid in _engine_groups(harness):
        os.killpg(record_pid, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def _engine_groups(harness: Hostd) -> list[int]:
    groups = []
    for name in ("a", "b", "c"):
        record = harness.record(name)
        if record is not None and record.process is not None and group_members(record.process.pgid):
            groups.append(record.process.pgid)
    return groups
