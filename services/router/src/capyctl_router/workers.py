"""The router's processes: a parent that holds the inference listener, and its workers.

`capyctl-router --role ROLE` is the parent (service `router`). It binds the inference
listener once, loads the workers' code, and forks `server.router.workers` worker processes
(services `router-0`, `router-1`, ...) that accept connections from that one socket and share
their state through Redis. A fork starts a worker in milliseconds and shares the loaded code
with the parent, where a new interpreter would import it all again (about a CPU-second).

A killed worker loses only the requests it was serving: the others keep taking connections
from the same queue, and the parent starts it again at once, removes it from the place
owners (its places are given back) and drops its gauges. Stopping the parent stops its
workers (SIGTERM: their requests may finish); a worker whose parent died stops too.

The workers' metrics are one set: each writes its own into a folder of the state dir
(Prometheus's multiprocess mode) and the /metrics of any of them sums them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import multiprocess

from capycommon import credentials
from capycommon.domain.places import owner_id
from capycommon.httpserve import bind
from capycommon.paths import write_atomic
from capycommon.service import REDIS_ERRORS, ServiceContext, until_stop, wait_event
from capycommon.settings import ServerSettings, StandaloneSettings
from capyctl_router import worker
from capyctl_router.metrics import start_cursors
from capyctl_router.remote import client_context
from capyctl_router.worker import worker_name

log = logging.getLogger(__name__)

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
_PR_SET_PDEATHSIG = 1
_die_with_parent = functools.partial(
    ctypes.CDLL(None, use_errno=True).prctl, _PR_SET_PDEATHSIG, int(signal.SIGTERM)
)
# The signals the parent's event loop handles: blocked across a fork, so that none reaches
# the child before it has let go of the parent's handlers.
_HANDLED = frozenset({signal.SIGTERM, signal.SIGINT})


async def run_workers(ctx: ServiceContext, argv: Sequence[str]) -> None:
    """Hold the listener and keep `server.router.workers` workers serving it until the stop."""
    assert isinstance(ctx.settings, StandaloneSettings | ServerSettings)
    server = ctx.settings.server
    credentials.load(ctx.paths.credentials)  # what would stop every worker, said once here
    if isinstance(ctx.settings, ServerSettings):
        client_context(ctx.paths)
    listener = bind(server.listeners.inference.bind)
    folder = _metrics_folder(ctx.paths.run_dir)
    log.info("starting %d workers", server.router.worker_count)
    try:
        async with asyncio.TaskGroup() as workers:
            for index in range(server.router.worker_count):
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
    quick_exits = 0
    while not ctx.stop.is_set():
        started = time.monotonic()
        child = Child(_fork(index, argv, listener, folder))
        try:
            code = await _until_exit(child, ctx.stop)
        finally:
            if child.returncode is None:  # the parent's own work was cancelled
                child.kill()
                await child.wait()
            await _gone(ctx, name, child.pid, folder)
        if ctx.stop.is_set():
            return
        quick_exits = quick_exits + 1 if time.monotonic() - started < RESTART_QUICK_S else 0
        pause = min(RESTART_PAUSE_MAX_S, 2.0 ** (quick_exits - 1)) if quick_exits else 0.0
        log.warning(
            "%s (pid %d) exited with %s; starting it again",
            name,
            child.pid,
            _exit_text(code),
            extra={"after_s": pause},
        )
        await wait_event(ctx.stop, pause)


def _fork(index: int, argv: Sequence[str], listener: socket.socket, folder: Path) -> int:
    """Fork worker `index`; its pid, in the parent. The child never returns: it leaves the
    parent's event loop and signal handlers behind, runs the worker, and exits."""
    parent = os.getpid()
    # What the parent holds now is the worker's for good: kept out of the worker's garbage
    # collections, which would otherwise walk it all (and copy every page they touch).
    gc.freeze()
    masked = signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
    pid = os.fork()
    if pid:
        signal.pthread_sigmask(signal.SIG_SETMASK, masked)
        return pid
    code = 1
    try:
        # A signal must not wake the parent's loop through the wakeup fd they share.
        signal.set_wakeup_fd(-1)
        for signum in _HANDLED:
            signal.signal(signum, signal.SIG_DFL)
        _die_with_parent()
        if os.getppid() != parent:  # the parent died before the line above
            os._exit(0)
        signal.pthread_sigmask(signal.SIG_SETMASK, masked)
        asyncio.events._set_running_loop(None)  # the parent's; the worker runs its own
        code = worker.main(index, argv, listener, folder)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # said here; the parent sees the exit code
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class Child:
    """A forked worker, watched through a pidfd: its exit wakes the event loop."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(pid)
        loop = asyncio.get_running_loop()
        self._exited = loop.create_future()
        loop.add_reader(self._pidfd, self._reap)

    def _reap(self) -> None:
        asyncio.get_running_loop().remove_reader(self._pidfd)
        os.close(self._pidfd)
        _, status = os.waitpid(self.pid, 0)
        self.returncode = os.waitstatus_to_exitcode(status)
        self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, signum: int) -> None:
        if self.returncode is None:  # not yet reaped: the pid is still this worker's
            os.kill(self.pid, signum)


async def _until_exit(child: Child, stop: asyncio.Event) -> int:
    """The worker's exit status; on the stop, it is asked to stop (then killed, if it has
    not after WORKER_STOP_S)."""
    exited = asyncio.ensure_future(child.wait())
    await until_stop(exited, stop)
    if not exited.done():
        child.terminate()
        done, _ = await asyncio.wait([exited], timeout=WORKER_STOP_S)
        if not done:
            child.kill()
    return await exited


async def _gone(ctx: ServiceContext, name: str, pid: int, folder: Path) -> None:
    """A worker exited: its places count no more, nor its gauges."""
    multiprocess.mark_process_dead(pid, str(folder))  # type: ignore[no-untyped-call]
    with contextlib.suppress(*REDIS_ERRORS):  # then its places expire with it
        await ctx.state.places.drop_owner(owner_id(name, pid, ctx.server))


def _exit_text(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"code {code}"
