"""`capyctl start <role>`: run a role's processes under supervisord, in the foreground.

The launcher holds the state dir's lock (and hands it to supervisord, so the lock lives as
long as either does), writes the configurations, runs supervisord, echoes every process's
log to its own output, and on SIGTERM or Ctrl-C stops everything within 30 s.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
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

from capycommon.errors import CapyError, Internal, StateCorrupt, StateDirInUse, ToolchainMissing
from capycommon.paths import StatePaths, ensure_private_dir, write_atomic
from capycommon.service import bind
from capycommon.settings import HostSettings, Role, host_name, setting_specs
from capycommon.state import persistence
from capycommon.units import format_size
from capycommon.version import __version__
from capyctl_cli import record, redisconf, supervisor
from capyctl_cli.roles import PROCESSES, Prepared, service_command

log = logging.getLogger("capyctl.launcher")

STOP_DEADLINE_S = 30.0
# Redis that exits at once this many times in a row cannot start (its data, most often).
REDIS_START_RETRIES = 3
# How often the launcher asks Redis whether it can save.
REFUSAL_EVERY_S = 2.0
_PR_SET_PDEATHSIG = 1


def acquire_lock(paths: StatePaths) -> int:
    """Hold the state dir's role lock, or refuse naming the role that holds it."""
    ensure_private_dir(paths.root)
    ensure_private_dir(paths.run_dir)
    fd = os.open(paths.role_lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _describe_holder(paths)
        raise StateDirInUse(
            f"{holder} already runs on the state dir {paths.root}; stop it first, or start "
            "this one with another --state-dir"
        ) from None
    return fd


def lock_is_held(paths: StatePaths) -> bool:
    """Whether a role holds the state dir's lock right now (checked without keeping it)."""
    try:
        fd = os.open(paths.role_lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _describe_holder(paths: StatePaths) -> str:
    found = record.read(paths)
    return "another role" if found is None else f"the {found.role} role (pid {found.pid})"


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


def programs(role: Role, prepared: Prepared) -> list[supervisor.Program]:
    result = []
    for name in PROCESSES[role]:
        if name == "redis":
            server = shutil.which("redis-server")
            if server is None:
                raise ToolchainMissing(
                    "redis-server is not installed; run `sudo apt-get install -y redis-server` "
                    "(or scripts/setup as root)"
                )
            write_atomic(prepared.paths.redis_conf, redisconf.render(prepared.paths))
            argv = [server, str(prepared.paths.redis_conf)]
            result.append(supervisor.Program("redis", argv, 10, 10, REDIS_START_RETRIES))
        else:
            result.append(supervisor.Program(name, service_command(name, role, prepared), 20, 8))
    return result


def check_listeners(prepared: Prepared) -> list[str]:
    """Refuse to start when a listener's port is taken; returns the listen addresses."""
    settings = prepared.loaded.settings
    if isinstance(settings, HostSettings):
        return []
    addresses = [
        settings.server.listeners.inference.bind,
        settings.server.listeners.management.bind,
    ]
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
    progs = programs(role, prepared)
    write_atomic(paths.supervisord_conf, supervisor.render(role, paths, progs))
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, lambda *_: stop.set())
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
    watch = RedisWatch(paths) if "redis" in PROCESSES[role] else None
    try:
        while proc.poll() is None and not stop.is_set():
            stop.wait(0.2)
            failure = watch.failure() if watch is not None else None
            if watch is not None:
                watch.report_refusal()
            if failure is not None:
                log.error("error [%s]: %s", failure.code, failure.message)
                _stop(proc)
                return failure.exit_code
        if proc.poll() is not None:
            log.error("supervisord exited with code %s; see %s", proc.returncode, paths.logs_dir)
            return 13
        log.info("stopping the %s role", role)
        return _stop(proc)
    finally:
        if watch is not None:
            watch.close()
        follower.stop()
        paths.role_record.unlink(missing_ok=True)


def _relay(source: IO[bytes], out: IO[str]) -> None:
    """Copy supervisord's own output to the launcher's. It writes there only when it cannot
    write its log, and an output it cannot write to either would stop it (a full disk under
    both): here such lines are lost instead."""
    for line in source:
        with contextlib.suppress(OSError, ValueError):
            out.write(line.decode("utf-8", "replace"))
            out.flush()


class RedisWatch:
    """Notices the role's redis-server giving up (it exited at once REDIS_START_RETRIES times
    in a row) and says why from its log, with the fix when its data is damaged; and says when
    it refuses writes because it cannot save them, and when it saves again."""

    def __init__(self, paths: StatePaths) -> None:
        self.paths = paths
        self._next = 0.0
        self._next_refusal = 0.0
        self._refusal: str | None = None
        self._client = redis.Redis.from_url(
            paths.redis_url, socket_timeout=2, socket_connect_timeout=2
        )

    def close(self) -> None:
        self._client.close()

    def report_refusal(self) -> None:
        now = time.monotonic()
        if now < self._next_refusal:
            return
        self._next_refusal = now + REFUSAL_EVERY_S
        try:
            refusal = persistence.save_failure(self._client)
        except (redis.RedisError, OSError):
            return  # not up yet, or restarting: failure() tells
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
        now = time.monotonic()
        if now < self._next:
            return None
        self._next = now + 1.0
        try:
            found = supervisor.processes(self.paths.supervisor_socket, timeout=2.0)
        except OSError:
            return None  # supervisord is not listening yet
        if not any(p.name == "redis" and p.state == "FATAL" for p in found):
            return None
        return redis_failure(self.paths)


def redis_failure(paths: StatePaths) -> CapyError:
    """Why the role's redis-server cannot start, from the last lines of its log."""
    lines = _tail(supervisor.log_file(paths, "redis"), 40)
    reason = next((line for line in reversed(lines) if "#" in line), "see its log")
    reason = reason.split("# ", 1)[-1].split(": make a backup", 1)[0].strip()
    aof = paths.redis_dir / "appendonly"
    if not any("AOF" in line or "append only" in line for line in lines):
        return Internal(
            f"Redis cannot start: {reason} (its log: {supervisor.log_file(paths, 'redis')})"
        )
    manifest = aof / "appendonly.aof.manifest"
    return StateCorrupt(
        f"Redis cannot load the role's data in {aof}: {reason}. Back it up first "
        f"(cp -a {aof} {aof}.bak), then repair it: redis-check-aof --fix {manifest}, and "
        "start again; what the repair drops (the last writes) CapyCTL re-reads from the hosts"
    )


def _tail(path: Path, count: int) -> list[str]:
    try:
        with path.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 16384))
            return file.read().decode("utf-8", "replace").splitlines()[-count:]
    except OSError:
        return []


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
            processes=list(PROCESSES[role]),
            redis_url=settings.redis.url or prepared.paths.redis_url,
            host=host_name(settings),
            listeners=listeners,
        ),
    )


class LogFollower:
    """Echo the lines appended to each process's log file onto one stream."""

    def __init__(self, files: list[Path], out: IO[str]) -> None:
        self.files = files
        self.out = out
        self.offsets = {path: path.stat().st_size if path.exists() else 0 for path in files}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-follower", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._poll()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._poll()

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
    """Lock the state dir, then prepare it and run the role while holding the lock."""
    lock_fd = acquire_lock(paths)
    try:
        return run(role, prepare(), lock_fd, env)
    finally:
        os.close(lock_fd)
