"""The scheduler end to end on a role with two simulated GPUs: where it places models, and
where a pinned one goes (a file of its own, so that its role starts on another worker than
the one-GPU scheduler tests')."""

from __future__ import annotations

from cluster import FOURTEEN, running


def test_placement_across_two_gpus() -> None:
    with running("sched2", "gpu0:24GiB,gpu1:24GiB") as cluster:
        cluster.deploy("p", engine_config=FOURTEEN)
        cluster.deploy("q", engine_config=FOURTEEN)
        cluster.deploy("r", engine_config=FOURTEEN, devices=[{"id": "gpu1"}])
        cluster.start("p")
        cluster.start("q")
        gpus = {n: cluster.status(n)["instances"][0]["gpu"] for n in "pq"}
        assert sorted(gpus.values()) == ["gpu0", "gpu1"], "the one with most headroom"
        cluster.start("r")
        assert cluster.status("r")["instances"][0]["gpu"] == "gpu1", "pinned"
        displaced = next(n for n in "pq" if gpus[n] == "gpu1")
        assert cluster.state(displaced) == "parked", "the switch happened on r's GPU"
        kept = next(n for n in "pq" if gpus[n] == "gpu0")
        assert cluster.state(kept) == "ready"
