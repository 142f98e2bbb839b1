"""hostd on a host with deep parking off: it says so, and launches no engine with its
development controls."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import cast

from capycommon.domain.hosts import HOST_CAPABILITIES, HostInfo
from capycommon.state import keys
from capycommon.version import __version__
from integration.hostd.harness import HOST, Hostd, environ, launch
from support import group_members, short_dir, wait_for


def test_deep_parking_off(redis_socket: Path, installs: dict[str, Path], model: Path) -> None:
    root = short_dir("hostd")
    harness = Hostd(
        root / "state", root / "home", redis_socket, settings={"CAPYCTL_DEEP_PARK": "off"}
    )
    harness.state.mkdir(mode=0o700, parents=True)
    gpu = harness.prepare(installs)
    harness.start()
    try:
        # Published as hostd starts serving, which may come after its first heartbeat.
        raw = wait_for(
            lambda: cast(bytes | None, harness.client.get(keys.host_info(HOST))),
            timeout=15,
            what="hostd's host info",
        )
        assert HostInfo.model_validate_json(raw) == HostInfo(
            version=__version__, capabilities=HOST_CAPABILITIES, deep_park=False
        )

        harness.send(launch("a", 1, gpu, model, residency="host_backed"))
        failed = harness.wait_state("a", "failed")
        assert failed.error is not None
        assert (
            "residency host_backed needs deep parking or the engine's development controls, "
            f"and deep parking is off on host {HOST} (host.deep_park: off)"
        ) in failed.error

        harness.send(launch("b", 1, gpu, model, residency="restart_only"))
        ready = harness.wait_state("b", "ready")
        assert ready.process is not None
        assert "VLLM_SERVER_DEV_MODE" not in environ(ready.process.pid)
    finally:
        harness.stop()
        record = harness.record("b")
        process = record.process if record is not None else None
        if process is not None and group_members(process.pgid):
            os.killpg(process.pgid, signal.SIGKILL)
        shutil.rmtree(root, ignore_errors=True)
