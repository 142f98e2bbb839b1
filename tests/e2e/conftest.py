"""The end-to-end tests' shared cluster: one role per test file, emptied after each test; and
the saved state the damaged-state tests damage copies of."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster import Cluster, running
from damagedstate import saved_state


@pytest.fixture(scope="module")
def one_gpu(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A standalone role on one 24 GiB GPU for a test file's tests, named after the file (a
    file overrides this fixture for other settings)."""
    with running(request.path.stem.removeprefix("test_")) as cluster:
        yield cluster


@pytest.fixture
def cluster(one_gpu: Cluster) -> Iterator[Cluster]:
    """The file's cluster, its deployments deleted after the test."""
    yield one_gpu
    one_gpu.clean()


@pytest.fixture(scope="module")
def saved() -> Iterator[Path]:
    """A stopped role's saved state dir, made once per file, for the damaged-state tests
    (test_damaged_*.py) to damage copies of (damagedstate.py)."""
    with saved_state() as state:
        yield state
