"""`capyctl start <role>`: run a role's processes under supervisord, in the foreground.

The launcher holds the state dir's lock (and hands it to supervisord, so the lock lives as
long as either does), writes the configurations, runs supervisord, echoes every process's
log to its own output, and on SIGTERM or Ctrl-C stops everything within 30 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

import redis

from capycommon.errors import CapyError
from capycommon.httpserve import bind
from capycommon.paths import StatePaths, write_atomic
from capycommon.redistarget import RedisTarget, control_target, target_for
from capycommon.settings import (
    HostSettings,
    Role,
    ServerSettings,
    host_name,
    server_tag,
    setting_specs,
)
from capycommon.units import format_size
from capycommon.version import __version__
from capyctl_cli import aofrepair, programs, record, stateversion, supervisor
from capyctl_cli.rolelock import acquire_lock
from capyctl_cli.roles import Prepared
from capyctl_cli.wakeups import Wake, drain, inotify

log = logging.getLogger("capyctl.launcher")

STOP_DEADLINE_S = 30.0
# Redis whose starts fail this many times in a row, none loading its data, cannot start. Two
# failures are not enough: a record cut short at the end of an earlier incremental file makes
# Redis cut it and exit, and when the cut leaves a transaction open (MULTI with no EXEC, as
# the scheduler's lease writes), its next start cuts that off and exits too; the third loads.
REDIS_FAILED_STARTS = 3
# How often the launcher asks Redis whether it can save (more often once it cannot, to say
# soon when it saves again).
REFUSAL_EVERY_S = 5.0
REFUSED_EVERY_S = 2.0
# How often it asks supervisord about Redis while it has no running redis-server to follow.
REDIS_CHECK_S = 1.0
_PR_SET_PDEATHSIG = 1


def child_environment(prepared: Prepared, env: Mapping[str, str]) -> dict[str, str]:
    """The environment of supervisord and its processes: the caller's, plus every flag as
    the variable of the same setting (its other names dropped, so they cannot disagree), and
    the host's name however it was chosen, so each service resolves exactly what the role
    did."""
    child = dict(env)
    specs = setting_specs(prepared.loaded.role)
    for row in prepared.loaded.rows:
        if row.source == "flag" or row.path == "host.name":
            spec = specs[row.path]
            for name in spec.variables:
                child.pop(name, None)
            child[spec.variable] = str(row.value)
    if prepared.loaded.settings.log.format == "auto":
        child["CAPYCTL_LOG_FORMAT"] = "text" if sys.stdout.isatty() else "json"
    child["PYTHONUNBUFFERED"] = "1"
    return child


def check_listeners(prepared: Prepared) -> list[str]:
    """Refuse to start when a listener's port is taken; returns the listen addresses."""
    settings = prepared.loaded.settings
    if isinstance(settings, HostSettings):
        return []
    addresses = [
        settings.server.listeners.inference.bind,
        settings.server.listeners.management.bind,
    ]
    if isinstance(settings, ServerSettings):
        addresses += [settings.enrollment.control_bind, settings.enrollment.bootstrap_bind]
        if settings.replication.enabled:  # its Sentinel, where its Redis's TLS port binds
            bind_host = settings.enrollment.control_bind.rpartition(":")[0]
            addresses.append(f"{bind_host}:{settings.replication.sentinel_port}")
    for address in addresses:
        bind(address).close()
    return addresses


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def run(role: Role, prepared: Prepared, lock_fd: int, env: Mapping[str, str]) -> int:
    """Run the role until SIGTERM or Ctrl-C; returns the exit code."""
    paths = prepared.paths
    check_listeners(prepared)
    progs = programs.programs(role, prepared)
    write_atomic(paths.supervisord_conf, supervisor.render(role, paths, progs))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
    watch: RedisWatch | HostStopWatch | None = None
    if "redis" in prepared.processes:
        watch = RedisWatch(paths, role == "server")  # before Redis's first start: it reads on
    elif role == "host":
        watch = HostStopWatch(paths)
    proc = subprocess.Popen(
        [sys.executable, "-m", "supervisor.supervisord", "-c", str(paths.supervisord_conf)],
        env=child_environment(prepared, env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        pass_fds=(lock_fd,),
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads run yet
    )
    assert proc.stdout is not None
    threading.Thread(target=_relay, args=(proc.stdout, sys.stdout), daemon=True).start()
    _write_record(role, prepared, proc.pid)
    follower = LogFollower([supervisor.log_file(paths, p.name) for p in progs], sys.stdout)
    follower.start()
    log.info(
        "%s role running", role, extra={"state_dir": str(paths.root), "supervisord_pid": proc.pid}
    )
    wake = Wake()
    signal.set_wakeup_fd(wake.writer, warn_on_full_buffer=False)  # a signal wakes the wait
    waiter = threading.Thread(target=_wake_on_exit, args=(proc, wake), daemon=True)
    waiter.start()
    try:
        return _until_stopped(role, proc, watch, wake, stop, paths)
    finally:
        signal.set_wakeup_fd(-1)
        waiter.join(timeout=1)  # supervisord is gone: its waiter writes no more
        if not waiter.is_alive():
            wake.close()
        if watch is not None:
            watch.close()
        follower.stop()
        paths.role_record.unlink(missing_ok=True)


def _until_stopped(
    role: Role,
    proc: subprocess.Popen[bytes],
    watch: RedisWatch | HostStopWatch | None,
    wake: Wake,
    stop: threading.Event,
    paths: StatePaths,
) -> int:
    """Wait for a stop (a signal), supervisord's exit or a failure `watch` sees, and stop
    supervisord where it still runs; returns the role's exit code."""
    while proc.poll() is None and not stop.is_set():
        failure = watch.failure() if watch is not None else None
        if watch is not None:
            watch.report_refusal()
        if failure is not None:
            log.error("error [%s]: %s", failure.code, failure.message)
            _stop(proc)
            return failure.exit_code
        if watch is None:
            wake.wait([], None)
        else:
            wake.wait(watch.fds(), max(0.0, watch.due() - time.monotonic()))
    if proc.poll() is not None:
        log.error("supervisord exited with code %s; see %s", proc.returncode, paths.logs_dir)
        return 13
    log.info("stopping the %s role", role)
    return _stop(proc)


def _wake_on_exit(proc: subprocess.Popen[bytes], wake: Wake) -> None:
    proc.wait()
    wake.set()


def _relay(source: IO[bytes], out: IO[str]) -> None:
    """Copy supervisord's own output to the launcher's. It writes there only when it cannot
    write its log, and an output it cannot write to either would stop it (a full disk under
    both): here such lines are lost instead."""
    for line in source:
        with contextlib.suppress(OSError, ValueError):
            out.write(line.decode("utf-8", "replace"))
            out.flush()


class HostStopWatch:
    """Notices a host service that cannot go on (revoked, its certificate refused, a server
    of another release line): it leaves `run/host-stopped` and exits with the error's code,
    which supervisord does not restart; the launcher then stops the role with that code.
    inotify on the run folder wakes it when the file appears."""

    def __init__(self, paths: StatePaths) -> None:
        self.paths = paths
        paths.host_stopped.unlink(missing_ok=True)
        self._watch = inotify({paths.run_dir})

    def fds(self) -> list[int]:
        return [] if self._watch is None else [self._watch]

    def due(self) -> float:
        """When to look again without being woken: at once never, unless inotify is
        missing (then every REDIS_CHECK_S)."""
        return math.inf if self._watch is not None else time.monotonic() + REDIS_CHECK_S

    def report_refusal(self) -> None:
        """Nothing to report: a host has no Redis of its own."""

    def failure(self) -> CapyError | None:
        if self._watch is not None:
            drain(self._watch)
        try:
            code, _, said = self.paths.host_stopped.read_text(encoding="utf-8").partition("\n")
        except OSError:
            return None
        return CapyError(said.strip() or "a host service stopped", code=code.strip())

    def close(self) -> None:
        if self._watch is not None:
            os.close(self._watch)


class RedisWatch:
    """Notices the role's redis-server giving up (its last REDIS_FAILED_STARTS starts failed,
    as its log tells, or supervisord gave up on it) and says why from its log, with the fix
    when its data is damaged; and says when it refuses writes because it cannot save them,
    and when it saves again.

    While a redis-server runs, a pidfd on it tells the moment it exits; supervisord is asked
    about Redis only until one runs and after it exited (every REDIS_CHECK_S)."""

    def __init__(self, paths: StatePaths, server: bool = False) -> None:
        self.paths = paths
        self._next = 0.0
        self._next_refusal = 0.0
        self._refusal: str | None = None
        self._pidfd: int | None = None
        self._starts = aofrepair.StartLog(supervisor.log_file(paths, "redis"))
        target = control_target(paths) if server else RedisTarget(paths.redis_url)
        self._state = record.blocking_to(target, timeout=2.0)

    def close(self) -> None:
        self._unfollow()
        self._state.close()

    def fds(self) -> list[int]:
        """What to wait on: the running redis-server's pidfd, readable once it exits."""
        return [] if self._pidfd is None else [self._pidfd]

    def due(self) -> float:
        """When (monotonic) the watch next has something to ask."""
        return (
            self._next_refusal if self._pidfd is not None else min(self._next, self._next_refusal)
        )

    def report_refusal(self) -> None:
        now = time.monotonic()
        if now < self._next_refusal or self._pidfd is None:
            # Only a redis-server that runs is asked: while one starts, fails or restarts, a
            # connection may take its whole timeout, and the watch would miss the moments
            # supervisord shows Redis exited, letting it start again and again.
            return
        self._next_refusal = now + REFUSAL_EVERY_S
        try:
            refusal = self._state(lambda s: s.persistence.save_failure())
        except (redis.RedisError, OSError):
            return  # not up yet, or restarting: failure() tells
        if refusal is not None:
            self._next_refusal = now + REFUSED_EVERY_S
        if refusal == self._refusal:
            return
        self._refusal = refusal
        if refusal is None:
            log.info("Redis saves the role's state again")
            return
        where = self.paths.redis_dir
        log.error(
            "Redis refuses writes: %s (%s free in %s); free space "
            "there and it takes writes again on its own; until then requests get 503",
            refusal,
            format_size(shutil.disk_usage(where).free),
            where,
        )

    def failure(self) -> CapyError | None:
        if self._pidfd is not None:
            if not select.select([self._pidfd], [], [], 0)[0]:
                return None  # the redis-server followed still runs
            self._unfollow()
            self._next = 0.0  # it exited: ask supervisord at once
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + REDIS_CHECK_S
        # The log is read before supervisord is asked: every start it counts began before
        # the answer, so an answer that Redis is not running means each of them is over.
        failed = self._starts.failed_in_a_row()
        try:
            found = supervisor.processes(self.paths.supervisor_socket, timeout=2.0)
        except OSError:
            return None  # supervisord is not listening yet
        redis_info = next((p for p in found if p.name == "redis"), None)
        if redis_info is None:
            return None
        if redis_info.state == "RUNNING" and redis_info.pid:
            self._follow(redis_info.pid)
        gave_up = redis_info.state == "FATAL"
        exited = redis_info.state in ("BACKOFF", "EXITED")  # its last start, too, is over
        # Read again: a start counted may have loaded since (its READY line came after).
        failed = min(failed, self._starts.failed_in_a_row())
        if gave_up or (exited and failed >= REDIS_FAILED_STARTS):
            return aofrepair.redis_failure(self.paths)
        return None

    def _follow(self, pid: int) -> None:
        try:
            self._pidfd = os.pidfd_open(pid)
        except OSError:
            self._pidfd = None  # gone already: the next check sees why

    def _unfollow(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_DEADLINE_S - 2)
    except subprocess.TimeoutExpired:
        log.error("supervisord did not stop within %.0f s; killing it", STOP_DEADLINE_S)
        proc.kill()
        proc.wait()
        return 13
    log.info("stopped")
    return 0


def _write_record(role: Role, prepared: Prepared, supervisord_pid: int) -> None:
    settings = prepared.loaded.settings
    listeners: dict[str, str] = {}
    if not isinstance(settings, HostSettings):
        listeners = {
            "inference": settings.server.listeners.inference.bind,
            "management": settings.server.listeners.management.bind,
        }
    record.write(
        prepared.paths,
        record.RoleRecord(
            role=role,
            version=__version__,
            pid=os.getpid(),
            supervisord_pid=supervisord_pid,
            started_at=time.time(),
            state_dir=str(prepared.paths.root),
            document=str(prepared.loaded.document) if prepared.loaded.document else None,
            processes=list(prepared.processes),
            redis_url=target_for(settings, prepared.paths).url,
            host=host_name(settings),
            listeners=listeners,
            server=server_tag(settings),
        ),
    )


class LogFollower:
    """Echo the lines appended to each process's log file onto one stream.

    inotify on the logs' folder wakes it when a file there is written, created or renamed in
    (a rotation); it still looks every UNHEARD_S, and every FALLBACK_S where inotify is not
    to be had."""

    UNHEARD_S = 5.0
    FALLBACK_S = 0.5

    def __init__(self, files: list[Path], out: IO[str]) -> None:
        self.files = files
        self.out = out
        self.offsets = {path: path.stat().st_size if path.exists() else 0 for path in files}
        self._stop = Wake()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="log-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._stop.set()
        self._thread.join(timeout=2)
        if not self._thread.is_alive():
            self._stop.close()
        self._poll()

    def _run(self) -> None:
        folders = {path.parent for path in self.files}
        watch = inotify(folders)
        fds = [] if watch is None else [watch]
        timeout = self.FALLBACK_S if watch is None else self.UNHEARD_S
        try:
            while not self._stopped:
                self._poll()
                self._stop.wait(fds, timeout)
                if watch is not None:
                    drain(watch)
        finally:
            if watch is not None:
                os.close(watch)

    def _poll(self) -> None:
        for path in self.files:
            try:
                size = path.stat().st_size
                if size < self.offsets[path]:  # rotated
                    self.offsets[path] = 0
                if size == self.offsets[path]:
                    continue
                with path.open("rb") as handle:
                    handle.seek(self.offsets[path])
                    chunk = handle.read(size - self.offsets[path])
            except OSError:
                continue
            complete = chunk.rfind(b"\n") + 1
            self.offsets[path] += complete
            if complete:
                try:
                    self.out.write(chunk[:complete].decode("utf-8", "replace"))
                    self.out.flush()
                except (OSError, ValueError):
                    return


def start(
    role: Role, prepare: Callable[[], Prepared], env: Mapping[str, str], paths: StatePaths
) -> int:
    """Lock the state dir, check which release started it last, then prepare it and run the
    role while holding the lock."""
    lock_fd = acquire_lock(paths)
    try:
        stateversion.admit(paths, __version__)
        return run(role, prepare(), lock_fd, env)
    finally:
        os.close(lock_fd)
