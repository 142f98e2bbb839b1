"""The chaos suite's cluster: one standalone role per test file, serving two small models
(the engine simulator as vLLM and as SGLang), both started before the first test."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from cluster import SMALL, Cluster, running
from hostilehost import Hostile, hostile_cluster

# The deployments the suite keeps busy, and the engine each runs on.
MODELS = {"alpha": "vllm", "beta": "sglang"}


@pytest.fixture(scope="module")
def two_models(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A standalone role on one 24 GiB GPU serving both models, named after the test file."""
    with running(request.path.stem.removeprefix("test_")) as cluster:
        for name, engine in MODELS.items():
            cluster.deploy(name, engine=engine, model="small", engine_config=SMALL)
        with openai.OpenAI(
            base_url=cluster.base_url, api_key=cluster.api_key, timeout=60, max_retries=0
        ) as client:
            for name in MODELS:  # each request starts its model
                client.chat.completions.create(
                    model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=1
                )
        yield cluster


@pytest.fixture(scope="module")
def hostile() -> Iterator[Hostile]:
    """A server with hosts ha and hb, s1 pinned to hb and serving; ha about to turn hostile
    (`hostilehost`)."""
    with hostile_cluster() as found:
        yield found
