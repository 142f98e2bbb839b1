"""hostd keeps its own record of the engines it launched, so an engine whose instance record
Redis lost (its append-only file deleted, a flush) is stopped, its memory released, rather
than left running with nothing counting it."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from capycommon import simgpu
from capycommon.domain.commands import Stop
from capycommon.domain.instances import InstanceRecord
from capycommon.paths import StatePaths
from integration.hostd.harness import GiB, Hostd, launch
from support import group_members, wait_for

LOST = "its record was lost with Redis's data; stopped so its memory is not left uncounted"


@pytest.fixture
def groups() -> Iterator[list[int]]:
    """The engines' process groups, killed after the test should any be left: once Redis has
    lost their records, the hostd fixture cannot find them."""
    found: list[int] = []
    yield found
    for pgid in found:
        if group_members(pgid):
            os.killpg(pgid, signal.SIGKILL)


def _owned(harness: Hostd) -> list[dict[str, Any]]:
    """hostd's own record of its engines, as on disk."""
    path = StatePaths(harness.state).engines_record
    return json.loads(path.read_text()) if path.exists() else []


def _gpu_used(harness: Hostd, gpu: str) -> int:
    """The bytes every live process claims on the simulated GPU."""
    usage = simgpu.usage(harness.simgpu_dir).get(gpu)
    return 0 if usage is None else usage.used_bytes


@pytest.fixture
def ready(hostd: tuple[Hostd, str], model: Path, groups: list[int]) -> InstanceRecord:
    """Engine `a` launched and ready, its record on disk as hostd keeps it."""
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model))
    ready = harness.wait_state("a", "ready")
    assert ready.process is not None
    groups.append(ready.process.pgid)
    wait_for(lambda: _gpu_used(harness, gpu) == 6 * GiB, timeout=5, what="the engine's claim")
    (entry,) = _owned(harness)
    assert entry["launch_id"] == ready.launch_id
    assert entry["process"] == ready.process.model_dump()
    assert entry["port"] == ready.port
    assert harness.secret("a") not in json.dumps(entry), "the key stays in Redis alone"
    path = StatePaths(harness.state).engines_record
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    return ready


def _assert_stopped_as_uncounted(
    harness: Hostd, gpu: str, ready: InstanceRecord, timeout: float
) -> None:
    """The engine is gone, its memory released, and hostd said why."""
    assert ready.process is not None
    pgid = ready.process.pgid
    wait_for(lambda: not _owned(harness), timeout=timeout, what="the engine's entry to go")
    assert group_members(pgid) == [], "the whole process group is gone"
    assert _gpu_used(harness, gpu) == 0, "its simulated GPU memory is released"
    assert f"a:0: launch {ready.launch_id}: {LOST}" in harness.log.read_text()
    assert ready.log_path is not None
    last = Path(ready.log_path).read_text().splitlines()[-1]
    assert last == f"capyctl: {LOST}; its processes are gone"
    assert harness.record("a") is None, "no record is made up in Redis"
    uncounted = [e for e in harness.events() if e["kind"] == "uncounted"]
    assert [(e["deployment"], e["generation"], e["reason"]) for e in uncounted] == [
        ("a", ready.generation, LOST)
    ], "the host's events say why"


def test_an_engine_whose_record_was_lost_while_hostd_was_down_is_stopped_at_start(
    hostd: tuple[Hostd, str], ready: InstanceRecord
) -> None:
    harness, gpu = hostd
    assert ready.process is not None
    harness.stop()  # SIGTERM: the engine keeps running
    assert group_members(ready.process.pgid), "the engine outlived hostd"
    harness.client.flushall()
    harness.start()
    _assert_stopped_as_uncounted(harness, gpu, ready, timeout=15)


def test_an_engine_whose_record_is_lost_under_a_running_hostd_is_stopped(
    hostd: tuple[Hostd, str], ready: InstanceRecord
) -> None:
    harness, gpu = hostd
    harness.client.flushall()
    _assert_stopped_as_uncounted(harness, gpu, ready, timeout=10)


def test_a_restart_with_redis_intact_keeps_the_record_of_engines(
    hostd: tuple[Hostd, str], ready: InstanceRecord
) -> None:
    harness, _ = hostd
    assert ready.process is not None
    before = _owned(harness)
    harness.stop()
    harness.start()
    wait_for(lambda: '"re-adopted"' in harness.log.read_text(), timeout=10, what="re-adoption")
    assert harness.record("a") == ready
    assert _owned(harness) == before

    # An engine launched before hostd kept this record is written into it on re-adoption.
    harness.kill9()
    StatePaths(harness.state).engines_record.unlink()
    harness.start()
    wait_for(lambda: _owned(harness) == before, timeout=10, what="the entry written again")
    assert group_members(ready.process.pgid), "the same engine runs on"

    harness.send(Stop(deployment="a", generation=1, reason="test"))
    harness.wait_state("a", "stopped")
    assert _owned(harness) == []


@pytest.mark.parametrize("flush", [False, True], ids=["redis-intact", "redis-lost"])
def test_an_engine_that_died_while_hostd_was_down_leaves_no_entry(
    hostd: tuple[Hostd, str], ready: InstanceRecord, flush: bool
) -> None:
    harness, _ = hostd
    assert ready.process is not None
    pgid = ready.process.pgid
    harness.stop()
    os.killpg(pgid, signal.SIGKILL)
    wait_for(lambda: not group_members(pgid), timeout=5, what="the engine to die")
    if flush:
        harness.client.flushall()
    harness.start()
    wait_for(lambda: not _owned(harness), timeout=10, what="the entry to go")
    if flush:
        assert harness.record("a") is None
        assert LOST not in harness.log.read_text(), "nothing was running to stop"
    else:
        assert "its engine is gone" in (harness.wait_state("a", "failed").error or "")
