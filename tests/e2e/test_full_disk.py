"""A role whose disk fills up says so and rides it out: Redis refuses writes, so requests get
503 with Retry-After and the reason, the launcher and `capyctl status` name the disk and the
fix, no service crashes or restarts, and service comes back on its own once there is room."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from capycommon.errors import CapyError
from cluster import Cluster, start_cluster
from support import holds_for, processes_mentioning, short_dir, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small disk needs root"),
]
HELLO = [{"role": "user", "content": "hello"}]


def _fill(folder: Path) -> Path:
    """Write zeros into the folder until its disk is full."""
    filler = folder / "filler"
    chunk = bytes(1 << 20)
    with filler.open("wb") as file, contextlib.suppress(OSError):
        while True:
            file.write(chunk)
            file.flush()
    return filler


def _pids(cluster: Cluster) -> dict[str, int | None]:
    return {name: found["pid"] for name, found in cluster.role.processes().items()}


def _ask(cluster: Cluster) -> httpx.Response:
    return httpx.post(
        f"{cluster.base_url}/chat/completions",
        json={"model": "a", "messages": HELLO, "max_tokens": 1},
        headers={"Authorization": f"Bearer {cluster.api_key}"},
        timeout=30,
    )


def _served(cluster: Cluster) -> httpx.Response | None:
    found = _ask(cluster)
    return found if found.status_code == 200 else None


def _ride_out(cluster: Cluster, root: Path, state: Path) -> None:
    cluster.deploy("a", engine="vllm", model="small")
    with openai.OpenAI(base_url=cluster.base_url, api_key=cluster.api_key) as client:
        client.chat.completions.create(model="a", messages=HELLO, max_tokens=1)  # type: ignore[arg-type]
    before = _pids(cluster)

    filler = _fill(state)
    refusal = wait_for(
        lambda: cluster.role.status()["redis_refuses_writes"],
        timeout=15,
        what="status to say that Redis refuses writes",
    )
    assert "append-only file" in refusal
    shown = cluster.ok("status")
    assert "redis refuses writes" in shown
    assert f"free in {state / 'redis'}); free space there" in shown

    answer = _ask(cluster)
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"] == "1"
    error = answer.json()["error"]
    assert error["code"] == "redis_unreachable"
    assert "No space left on device" in error["message"]

    refused = cluster.cli("deploy", "model", "--file", str(root / "a.yaml"))
    assert refused.returncode != 0
    assert "redis_unreachable" in refused.stderr
    assert "Traceback" not in refused.stderr

    # Long enough for a crash, a restart or a heartbeat to lapse.
    holds_for(lambda: _pids(cluster) == before, 5, "no process restarted")
    said = [line for line in cluster.role.output().splitlines() if '"service": "capyctl"' in line]
    assert sum("Redis refuses writes" in line for line in said) == 1, "the launcher said it once"

    filler.unlink()
    wait_for(
        lambda: cluster.role.status()["redis_refuses_writes"] is None,
        timeout=15,
        what="Redis to take writes again",
    )
    answer = wait_for(lambda: _served(cluster), timeout=15, what="a request to be served again")
    assert answer.json()["choices"][0]["message"]["content"]
    assert _pids(cluster) == before, "no process restarted"
    # The launcher asks Redis every 2 s once it refused, so it may say so after the status.
    wait_for(
        lambda: "Redis saves the role's state again" in cluster.role.output(),
        timeout=15,
        what="the launcher to say that Redis saves again",
    )


def test_a_full_disk_is_reported_and_ridden_out() -> None:
    root = short_dir("fulldisk")
    state = root / "state"
    state.mkdir(mode=0o700)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(state)], check=True
    )
    cluster: Cluster | None = None
    try:
        cluster = start_cluster(root, "gpu0:24GiB")
        _ride_out(cluster, root, state)
    finally:
        try:
            if cluster is not None:
                with contextlib.suppress(AssertionError, CapyError):
                    cluster.clean()
                cluster.close()
                cluster.role.stop()
        finally:
            for pid in processes_mentioning(str(root)):  # engines a failed clean left running
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["umount", "-l", str(state)], check=False)
            shutil.rmtree(root, ignore_errors=True)
