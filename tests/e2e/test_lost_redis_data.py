"""A role whose Redis lost its data (the append-only file deleted) stops the engines it finds
running with no record, so no memory is left uncounted and a redeploy starts one engine."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from capycommon import simgpu
from capycommon.domain.instances import InstanceRecord
from cluster import Cluster
from support import group_members, live_processes, processes_mentioning, start_role, wait_for


def _ready(cluster: Cluster) -> InstanceRecord:
    """Declare the model, start it and return its ready instance record."""
    cluster.deploy("lost", model="small")
    cluster.start("lost")
    record = cluster.instance("lost")
    assert record is not None
    assert record.state == "ready"
    assert record.process is not None
    return record


def _engine_groups(model: Path) -> set[int]:
    """The process groups of every engine serving `model`."""
    return {p.pgid for p in live_processes() if str(model) in p.cmdline}


def _gpu_used(state: Path) -> int:
    return sum(usage.used_bytes for usage in simgpu.usage(state / "simgpu").values())


def test_a_role_whose_redis_lost_its_data_leaves_no_engine_uncounted(cluster: Cluster) -> None:
    state = cluster.role.state_dir
    hostd_log = state / "logs" / "hostd.log"
    first = _ready(cluster)
    assert first.process is not None
    launch_id = first.launch_id
    assert launch_id is not None
    one_engine = _gpu_used(state)
    assert one_engine > 0
    try:
        assert cluster.role.stop() == 0
        assert group_members(first.process.pgid), "the engine outlived the role"

        shutil.rmtree(state / "redis" / "appendonly")
        cluster.role = start_role(
            "standalone",
            state_dir=state,
            env=cluster.role.env,
            extra=["--config", str(cluster.root / "standalone.yaml")],
        )
        wait_for(
            lambda: not processes_mentioning(launch_id),
            timeout=30,
            what="the old launch's engine and log writer to be stopped",
        )
        assert group_members(first.process.pgid) == []
        assert _gpu_used(state) == 0, "its memory is released"
        wait_for(
            lambda: "its record was lost with Redis's data" in hostd_log.read_text(),
            timeout=10,
            what="hostd to say why it stopped the engine",
        )
    finally:  # never an engine left behind should the role not stop it
        if group_members(first.process.pgid):
            os.killpg(first.process.pgid, signal.SIGKILL)

    second = _ready(cluster)
    assert second.process is not None
    assert second.launch_id != launch_id
    assert _engine_groups(cluster.root / "models" / "small") == {second.process.pgid}
    assert _gpu_used(state) == one_engine, "exactly one engine holds memory"
