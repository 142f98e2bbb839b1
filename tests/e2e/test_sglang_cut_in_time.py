"""SGLang 0.5.22 requests the router cuts itself, by their deadline (no answer in time) or by
the stream's idle bound (silence after the first token): each is aborted by its id, and its
place settles once hostd reports that the engine ended it, long before the engine would have
finished it, or noticed the closed connection itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from cluster import SMALL, Cluster, running
from enginesim.behaviour import Behaviour, DisconnectLag, Faults
from enginesim.install import install_python_engine
from support import wait_for

HI: list[Any] = [{"role": "user", "content": "hi"}]
IDLE_S = 1
# SGLang's own abort of a request whose connection closed comes a minute late here: a request
# that ends at once was aborted by its id.
LATE = Faults(disconnect_abort_lag=DisconnectLag(non_stream=60, stream=60))


@pytest.fixture(scope="module")
def one_gpu() -> Iterator[Cluster]:
    with running("cut-in-time", routing={"stream_idle_timeout": IDLE_S}) as cluster:
        yield cluster


def _sglang(cluster: Cluster, name: str, behaviour: Behaviour, **document: Any) -> None:
    install = install_python_engine(cluster.root / "e" / name, "sglang", "0.5.22", behaviour)
    cluster.ok("engine", "add", str(install), "--name", name)
    cluster.deploy(name, engine=name, model="small", engine_config=SMALL, **document)
    cluster.start(name)


def _ended_by_its_id(cluster: Cluster, name: str, aborted: int) -> None:
    wait_for(lambda: cluster.engine_running(name) == 0, 15, what="the engine to end it")
    assert cluster.engine_aborted(name) > aborted, "aborted by its id"
    wait_for(lambda: cluster.places(name).running == 0, 15, what="its place to settle on its end")


def test_a_request_cut_by_its_deadline_is_aborted_by_id_and_settled(cluster: Cluster) -> None:
    # 3 s of prefill (within the 5 s its health check waits, which generates): no answer
    # within a 1 s deadline.
    slow = Behaviour(load_seconds=0.5, prefill_seconds=3, faults=LATE)
    _sglang(cluster, "late", slow, request_deadline="1s")
    aborted = cluster.engine_aborted("late")
    with pytest.raises(openai.APIStatusError) as cut:
        cluster.openai().chat.completions.create(model="late", messages=HI, max_tokens=8)
    assert cut.value.status_code == 503
    assert "no answer in time (deadline)" in cut.value.message
    _ended_by_its_id(cluster, "late", aborted)


def test_a_stream_cut_by_its_idle_bound_is_aborted_by_id_and_settled(cluster: Cluster) -> None:
    # A token every 2.5 s (its health check's one token within the 5 s it waits): the
    # stream's first comes, then a silence longer than the 1 s bound.
    quiet = Behaviour(load_seconds=0.5, tokens_per_second=0.4, faults=LATE)
    _sglang(cluster, "quiet", quiet)
    aborted = cluster.engine_aborted("quiet")
    stream = cluster.openai().chat.completions.create(
        model="quiet", messages=HI, max_tokens=50, stream=True
    )
    with pytest.raises(openai.APIError, match=r"no answer in time \(stream idle\)"):
        for _ in stream:
            pass
    _ended_by_its_id(cluster, "quiet", aborted)
