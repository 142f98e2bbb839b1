"""An instance's private LMCache server: started and healthy before its engine, registration
confirmed before the instance is ready, stopped after the engine (`capycommon.engines.lmcache`).

The server runs in a session of its own, as engines do, so it outlives a restart of hostd;
hostd's own record of the servers it started (`Kept`, in its state dir) finds it again, or
stops it when no instance record names it. Its output goes to the log writer of the launch
that started it, which the engine then shares: one log for both. A server kept through a
restart_only park keeps writing there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from capycommon import procfs
from capycommon.engines import lmcache
from capycommon.engines.launch import ENGINE_HOST
from capycommon.engines.lmcache import ServerPorts
from capycommon.engines.registry import EngineProfile
from capycommon.errors import LaunchFailed
from capycommon.paths import write_atomic
from capycommon.state.instances import CacheRecord
from capyctl_hostd import procs

log = logging.getLogger(__name__)

HEALTH_PATHS = ("/api/healthcheck", "/healthcheck")
STATUS_PATHS = ("/api/status", "/status")
POLL_S = 0.05
# How long a server may take to be healthy, and the engine to register with it once ready.
HEALTHY_WITHIN_S = 120.0
REGISTERED_WITHIN_S = 60.0
WRITER_END_S = 5.0


@dataclass
class CacheServer:
    """A running server hostd holds: started here, or found again after a restart."""

    member: str
    record: CacheRecord
    process: subprocess.Popen[bytes] | None = None  # None when found again
    # The log writer it shares with the engine of its launch (None when found again).
    writer: subprocess.Popen[bytes] | None = None
    # Which of HEALTH_PATHS and STATUS_PATHS the server answers (its release decides).
    health_path: str | None = None
    status_path: str | None = None

    @property
    def ports(self) -> ServerPorts:
        return ServerPorts(self.record.zmq_port, self.record.http_port, self.record.metrics_port)

    @property
    def pgid(self) -> int:
        return self.record.process.pgid

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return procs.is_alive(self.record.process)

    def fits(self, install: EngineProfile, revision: int, pool_bytes: int) -> bool:
        """Whether a launch of `revision` may connect to it: the same build, pool and revision
        (its chunk keys are seeded by the revision)."""
        record = self.record
        return (
            record.fingerprint == install.fingerprint
            and record.revision == revision
            and record.pool_bytes == pool_bytes
            and self.alive()
        )

    async def healthy(self, http: httpx.AsyncClient) -> bool:
        """One health probe: the path the server answers is found on the first."""
        found = await self._ask(http, self.health_path, HEALTH_PATHS)
        if found is None:
            return False
        self.health_path, answer = found
        return answer.status_code == 200

    async def registered(self, http: httpx.AsyncClient) -> bool:
        """Whether an engine's GPU is registered with it (`registered_gpu_ids`)."""
        found = await self._ask(http, self.status_path, STATUS_PATHS)
        if found is None:
            return False
        self.status_path, answer = found
        try:
            return bool(answer.json().get("registered_gpu_ids"))
        except (ValueError, AttributeError):
            return False

    async def _ask(
        self, http: httpx.AsyncClient, known: str | None, paths: tuple[str, ...]
    ) -> tuple[str, httpx.Response] | None:
        """GET the path the server is known to answer, else the first of `paths` it does not
        answer 404 (a release serves one of them); None when it cannot be reached."""
        for path in (known,) if known else paths:
            try:
                answer = await http.get(f"{_base(self.ports)}{path}", timeout=2.0)
            except httpx.HTTPError:
                return None
            if answer.status_code != 404:
                return path, answer
        return None


def _base(ports: ServerPorts) -> str:
    return f"http://{ENGINE_HOST}:{ports.http}"


def start(
    member: str,
    install: EngineProfile,
    ports: ServerPorts,
    revision: int,
    pool_bytes: int,
    charged: tuple[int, int],
    gpu_uuid: str,
    log_path: Path,
    writer: subprocess.Popen[bytes],
    cwd: Path,
) -> CacheServer:
    """Start the server, its output to the launch's log `writer`."""
    assert writer.stdin is not None
    seed = lmcache.hash_seed(member.rpartition(":")[0], revision)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), **lmcache.server_env(seed, gpu_uuid)}
    process = subprocess.Popen(
        lmcache.server_argv(install, ports, pool_bytes),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=writer.stdin,
        stderr=subprocess.STDOUT,
        cwd=cwd,
        start_new_session=True,
    )
    found = procs.identity(process.pid)
    if found is None:  # gone already: its exit says why
        process.wait()
        raise LaunchFailed(
            f"the LMCache server exited with code {process.returncode} at once; see {log_path}"
        )
    record = CacheRecord(
        profile=install.name,
        version=install.version,
        fingerprint=install.fingerprint,
        revision=revision,
        zmq_port=ports.zmq,
        http_port=ports.http,
        metrics_port=ports.metrics,
        pool_bytes=pool_bytes,
        process=found,
        log_path=str(log_path),
        host_bytes=charged[0],
        device_bytes=charged[1],
    )
    log.info("LMCache server started", extra={"member": member, "pid": process.pid})
    return CacheServer(member, record, process, writer)


async def wait_healthy(server: CacheServer, deadline_s: float = HEALTHY_WITHIN_S) -> None:
    """Until the server reports healthy; fail at once if it exits, or at the deadline."""
    failure = (
        f"the LMCache server was not healthy within {deadline_s:g} s; see {server.record.log_path}"
    )
    await _until(server, server.healthy, deadline_s, failure, "while starting")


async def wait_registered(server: CacheServer, deadline_s: float = REGISTERED_WITHIN_S) -> None:
    """Until the engine registered with the server; fail at the deadline."""
    failure = (
        f"the engine did not register with its LMCache server within {deadline_s:g} s "
        "(no GPU in its /api/status registered_gpu_ids)"
    )
    await _until(server, server.registered, deadline_s, failure, "before the engine registered")


async def _until(
    server: CacheServer,
    check: Callable[[httpx.AsyncClient], Awaitable[bool]],
    deadline_s: float,
    failure: str,
    when: str,
) -> None:
    """Until `check` holds, probing every POLL_S; LaunchFailed if the server exits, or with
    `failure` at the deadline."""
    started = time.monotonic()
    async with httpx.AsyncClient() as http:
        while not await check(http):
            _check_alive(server, when)
            if time.monotonic() - started > deadline_s:
                raise LaunchFailed(failure)
            await asyncio.sleep(POLL_S)


def _check_alive(server: CacheServer, when: str) -> None:
    if not server.alive():
        code = server.process.returncode if server.process is not None else "unknown"
        raise LaunchFailed(
            f"the LMCache server exited (code {code}) {when}; see {server.record.log_path}"
        )


async def stop(server: CacheServer) -> None:
    """Stop the server's group and wait until it is gone, and its log written."""
    await procs.stop_group(server.pgid)
    if server.process is not None:
        server.process.wait()
    if server.writer is not None:
        if server.writer.stdin is not None:
            server.writer.stdin.close()  # still ours if the engine never started
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(server.writer.wait, WRITER_END_S)
    log.info("LMCache server stopped", extra={"member": server.member, "pid": server.pgid})


def resident_bytes(server: CacheServer) -> int | None:
    """The server's resident memory, its group's processes together (None if unreadable)."""
    total = sum(procfs.rss_bytes(pid) for pid in procs.group_members(server.pgid))
    return total or None


class KeptServer(BaseModel):
    """hostd's own record of one server it started: enough to find it again or stop it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    member: str
    record: CacheRecord


_KEPT = TypeAdapter(list[KeptServer])


class Kept:
    """The servers hostd started and has not seen gone, in its state dir (owner-only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: dict[str, KeptServer] = {}
        try:
            found = _KEPT.validate_json(path.read_bytes())
        except FileNotFoundError:
            found = []
        except (OSError, ValidationError) as exc:
            log.error("ignoring an unreadable record of LMCache servers %s: %s", path, exc)
            found = []
        self.entries = {entry.member: entry for entry in found}

    def keep(self, server: CacheServer) -> None:
        entry = KeptServer(member=server.member, record=server.record)
        if self.entries.get(server.member) != entry:
            self.entries[server.member] = entry
            self._write()

    def drop(self, member: str) -> None:
        if self.entries.pop(member, None) is not None:
            self._write()

    def _write(self) -> None:
        data = _KEPT.dump_json(list(self.entries.values()), indent=2).decode()
        write_atomic(self.path, data)


def found_again(member: str, record: CacheRecord) -> CacheServer:
    """A server hostd did not start in this run, as an instance record names it."""
    return CacheServer(member, record)
