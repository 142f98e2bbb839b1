"""The router's processes: a parent that holds the inference listener, and its workers.

`capyctl-router --role ROLE` is the parent (service `router`). It binds the inference
listener once and runs `server.router.workers` worker processes (services `router-0`,
`router-1`, ...) that accept connections from that one socket and share their state through
Redis. A killed worker loses only the requests it was serving: the others keep taking
connections from the same queue, and the parent starts it again at once, removes it from
the place owners (its places are given back) and drops its gauges. Stopping the parent stops
its workers (SIGTERM: their requests may finish); a worker whose parent died stops too.

The workers' metrics are one set: each writes its own into a folder of the state dir
(Prometheus's multiprocess mode) and the /metrics of any of them sums them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import multiprocess

from capycommon import credentials
from capycommon.paths import write_atomic
from capycommon.service import REDIS_ERRORS, ServiceContext, bind, until_stop, wait_event
from capycommon.settings import ServerSettings, StandaloneSettings
from capycommon.state import places
from capyctl_router.metrics import start_cursors
from capyctl_router.remote import client_context

log = logging.getLogger(__name__)

# Names the folder of Prometheus's multiprocess mode, for the workers' metrics.
METRICS_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
# Memory-backed files, where the machine has them; the folder is made by mkdtemp (0700).
SHARED_MEMORY = Path("/dev/shm")  # noqa: S108
METRICS_PREFIX = "capyctl-router-metrics-"
# A worker that exits within this of its start is started again after a pause that doubles
# with each such exit in a row (up to RESTART_PAUSE_MAX_S); any other, at once.
RESTART_QUICK_S = 1.0
RESTART_PAUSE_MAX_S = 30.0
# How long a stopping worker may finish its requests before it is killed (within the 10 s
# a service's own work has to stop).
WORKER_STOP_S = 9.0
# prctl(PR_SET_PDEATHSIG, SIGTERM) in a worker before it runs: it stops when its parent dies.
# The call is made ready here, as a child between fork and exec must not load anything.
_PR_SET_PDEATHSIG = 1
_die_with_parent = functools.partial(
    ctypes.CDLL(None, use_errno=True).prctl, _PR_SET_PDEATHSIG, int(signal.SIGTERM)
)


def worker_name(index: int) -> str:
    return f"router-{index}"


async def run_workers(ctx: ServiceContext, argv: Sequence[str]) -> None:
    """Hold the listener and keep `server.router.workers` workers serving it until the stop."""
    assert isinstance(ctx.settings, StandaloneSettings | ServerSettings)
    server = ctx.settings.server
    credentials.load(ctx.paths.credentials)  # what would stop every worker, said once here
    if isinstance(ctx.settings, ServerSettings):
        client_context(ctx.paths)
    listener = bind(server.listeners.inference.bind)
    folder = _metrics_folder(ctx.paths.run_dir)
    log.info("starting %d workers", server.router.workers)
    try:
        async with asyncio.TaskGroup() as workers:
            for index in range(server.router.workers):
                workers.create_task(_keep_worker(ctx, index, argv, listener, folder))
    finally:
        listener.close()
        shutil.rmtree(folder, ignore_errors=True)


def _metrics_folder(run_dir: Path) -> Path:
    """A new folder for the workers' metrics, in memory where the machine has /dev/shm: the
    workers write to it through mmap on every request, and a full disk answers such a write
    with SIGBUS. Its path is kept in the run dir, so that the next router removes it even
    when this one was killed."""
    record = run_dir / "router-metrics.path"
    with contextlib.suppress(OSError):
        earlier = Path(record.read_text(encoding="utf-8"))
        if earlier.name.startswith(METRICS_PREFIX):
            shutil.rmtree(earlier, ignore_errors=True)
    place = SHARED_MEMORY if SHARED_MEMORY.is_dir() else run_dir
    folder = Path(tempfile.mkdtemp(prefix=METRICS_PREFIX, dir=place))
    start_cursors(folder)
    write_atomic(record, str(folder))
    return folder


async def _keep_worker(
    ctx: ServiceContext, index: int, argv: Sequence[str], listener: socket.socket, folder: Path
) -> None:
    """Run worker `index` until the stop, starting it again whenever it exits."""
    name = worker_name(index)
    fd = listener.fileno()
    command = [sys.executable, "-m", "capyctl_router", *argv]
    command += ["--worker", str(index), "--listen-fd", str(fd)]
    env = {**os.environ, METRICS_VARIABLE: str(folder)}
    quick_exits = 0
    while not ctx.stop.is_set():
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *command, env=env, pass_fds=(fd,), preexec_fn=_die_with_parent
        )
        try:
            code = await _until_exit(proc, ctx.stop)
        finally:
            if proc.returncode is None:  # the parent's own work was cancelled
                proc.kill()
                await proc.wait()
            await _gone(ctx, name, proc.pid, folder)
        if ctx.stop.is_set():
            return
        quick_exits = quick_exits + 1 if time.monotonic() - started < RESTART_QUICK_S else 0
        pause = min(RESTART_PAUSE_MAX_S, 2.0 ** (quick_exits - 1)) if quick_exits else 0.0
        log.warning(
            "%s (pid %d) exited with %s; starting it again",
            name,
            proc.pid,
            _exit_text(code),
            extra={"after_s": pause},
        )
        await wait_event(ctx.stop, pause)


async def _until_exit(proc: asyncio.subprocess.Process, stop: asyncio.Event) -> int:
    """The worker's exit status; on the stop, it is asked to stop (then killed, if it has
    not after WORKER_STOP_S)."""
    exited = asyncio.ensure_future(proc.wait())
    await until_stop(exited, stop)
    if not exited.done():
        proc.terminate()
        done, _ = await asyncio.wait([exited], timeout=WORKER_STOP_S)
        if not done:
            proc.kill()
    return await exited


async def _gone(ctx: ServiceContext, name: str, pid: int, folder: Path) -> None:
    """A worker exited: its places count no more, nor its gauges."""
    multiprocess.mark_process_dead(pid, str(folder))  # type: ignore[no-untyped-call]
    with contextlib.suppress(*REDIS_ERRORS):  # then its places expire with it
        await places.drop_owner(ctx.redis, places.owner_id(name, pid))


def _exit_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"
