"""The processes of a model across two GPUs: a restart of the role re-adopts the running
engine with every rank, and a killed rank takes the whole engine down, leaving no process
and no memory behind (a file of its own, so that its role starts on another worker)."""

from __future__ import annotations

import os
import signal

from capycommon.domain.memory import MemoryReading
from cluster import running
from spans import BIG, GPUS, ask, heads_model, ranks
from support import group_members, wait_for

GiB = 1 << 30


def test_a_restarted_role_readopts_every_rank_and_a_killed_rank_ends_the_engine() -> None:
    with running("tpranks", GPUS) as cluster:
        heads_model(cluster.root / "models" / "big30", 30 * GiB)
        cluster.deploy("big", model="big30", residency="deep", engine_config=BIG)
        ask(cluster.openai(), "big")
        record = cluster.instance("big")
        assert record is not None
        assert record.process is not None
        assert record.gpu_uuids, "the record names every GPU of its set"
        pgid = record.process.pgid
        held = ranks(cluster, "big")

        assert cluster.role.stop() == 0
        alive = group_members(pgid)
        assert {pid for pids in held.values() for pid in pids} <= set(alive), "ranks run on"
        cluster.start_again()
        wait_for(lambda: "re-adopted" in cluster.role.output(), timeout=30, what="re-adoption")
        assert cluster.instance("big") == record, "re-adopted as it was"
        ask(cluster.openai(), "big")

        (victim,) = held["gpu1"]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not group_members(pgid), timeout=30, what="every process of the engine")
        failed = wait_for(
            lambda: [t for t in cluster.transitions("big") if t[1] == "failed"],
            timeout=30,
            what="the instance failed",
        )
        assert failed

        def released() -> bool:
            reading: MemoryReading | None = cluster.blocking(lambda s: s.memory.reading("local"))
            return reading is not None and not any(
                pid in alive for gpu in reading.gpus for pid in gpu.processes
            )

        wait_for(released, timeout=15, what="no memory held by the engine's processes")
