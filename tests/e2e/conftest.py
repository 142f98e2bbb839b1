"""The end-to-end tests' shared cluster: one role per test file, emptied after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cluster import Cluster, running


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
