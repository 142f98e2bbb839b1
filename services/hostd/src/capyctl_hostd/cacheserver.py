"""An instance's private LMCache server: started and healthy before its engine, registration
confirmed before the instance is ready, stopped after the engine (`capycommon.engines.lmcache`).

The server runs in a session of its own, as engines do, so it outlives a restart of hostd;
hostd's own record of the servers it started (`Kept`, in its state dir) finds it again, or
stops it when no instance record names it. Its output goes to the log writer of the launch
that started it, which the engine then shares: one log for both. A server kept through a
restart_only park keeps writing there.

`CacheServers` holds hostd's servers, by member: it gives a launch its server (the one a park
kept, when it fits, else a new one on three leased ports), and stops one, its ports coming back.
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
from pydantic import BaseModel, ConfigDict, TypeAdapter

from capycommon import procfs
from capycommon.domain import commands as hc
from capycommon.domain.instances import CacheRecord, InstanceRecord
from capycommon.engines import lmcache
from capycommon.engines.families import Family
from capycommon.engines.launch import ENGINE_HOST
from capycommon.engines.lmcache import ServerPorts
from capycommon.engines.registry import EngineProfile
from capycommon.errors import LaunchFailed
from capycommon.state.stores import State
from capyctl_hostd import engines, procs
from capyctl_hostd.ports import PortLeaser
from capyctl_hostd.recordfile import RecordFile

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


class Kept(RecordFile[KeptServer]):
    """The servers hostd started and has not seen gone, in its state dir (owner-only)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, _KEPT, "LMCache servers")

    def keep_server(self, server: CacheServer) -> None:
        self.keep(KeptServer(member=server.member, record=server.record))


class CacheServers:
    """The LMCache servers hostd holds, by member: beside a live engine, or kept through a
    restart_only park; with hostd's own record of them (`Kept`) and the ports they hold."""

    def __init__(
        self,
        kept: Path,
        ports: PortLeaser,
        state: State,
        host: str,
        runtime_dir: Path,
    ) -> None:
        self.servers: dict[str, CacheServer] = {}
        self.kept = Kept(kept)
        self.ports = ports
        self.state = state
        self.host = host
        self.runtime_dir = runtime_dir

    async def for_launch(
        self,
        command: hc.Launch,
        record: InstanceRecord,
        log_path: Path | None,
        secret: str,
        profiles: dict[str, EngineProfile],
    ) -> tuple[CacheServer | None, subprocess.Popen[bytes] | None]:
        """The LMCache server the engine connects to, healthy: the one a restart_only park
        kept, when it fits this launch, else one started now (with the launch's log writer,
        which the engine then shares). A kept server that does not fit is stopped first."""
        wanted = command.cache
        install = None if wanted is None else profiles.get(wanted.profile)
        held = self.servers.get(record.member)
        if held is not None and (
            install is None
            or wanted is None
            or not held.fits(install, command.revision, wanted.pool_bytes)
        ):
            await self.stop_member(record.member, "it does not fit this launch")
            held = None
        if wanted is None:
            return None, None
        if install is None or install.family != Family.LMCACHE:
            raise LaunchFailed(
                f"no LMCache named {wanted.profile!r} is registered on host {self.host}"
            )
        if held is not None:
            await wait_healthy(held, REGISTERED_WITHIN_S)
            log.info("%s: connects to the LMCache server a park kept", record.member)
            return held, None
        assert log_path is not None, "retention: zero never starts LMCache"
        writer = engines.open_log(log_path, secret)
        server = self._start(record, install, command.revision, wanted, log_path, writer)
        await wait_healthy(server)
        rss = resident_bytes(server)
        if rss is not None:
            await self.state.memory.write_cache_server_rss(self.host, install.fingerprint, rss)
        return server, writer

    def _start(
        self,
        record: InstanceRecord,
        install: EngineProfile,
        revision: int,
        wanted: hc.CacheLaunch,
        log_path: Path,
        writer: subprocess.Popen[bytes],
    ) -> CacheServer:
        """A new server for the launch `record` names, on three leased ports, held from now; if
        it does not start, its ports come back and its log writer is closed."""
        ports = ServerPorts(self.ports.lease(), self.ports.lease(), self.ports.lease())
        assert record.gpu_uuid is not None
        try:
            server = start(
                record.member,
                install,
                ports,
                revision,
                wanted.pool_bytes,
                (wanted.host_bytes, wanted.device_bytes),
                record.gpu_uuid,
                log_path,
                writer,
                self.runtime_dir,
            )
        except BaseException:
            for port in (ports.zmq, ports.http, ports.metrics):
                self.ports.release(port)
            if writer.stdin is not None:
                writer.stdin.close()
            raise
        self.servers[record.member] = server
        self.kept.keep_server(server)
        return server

    async def stop_member(self, member: str, why: str) -> CacheServer | None:
        """Stop the member's LMCache server, if hostd holds one; its ports come back."""
        server = self.servers.pop(member, None)
        if server is None:
            return None
        log.info("%s: stopping its LMCache server: %s", member, why)
        await stop(server)
        for port in (server.record.zmq_port, server.record.http_port, server.record.metrics_port):
            self.ports.release(port)
        self.kept.drop(member)
        return server

    def found_again(self, member: str, record: CacheRecord) -> None:
        """Hold again a server hostd did not start in this run, which an instance record names
        and which still runs, with its ports."""
        server = CacheServer(member, record)
        self.servers[member] = server
        self.kept.keep_server(server)
        for port in (record.zmq_port, record.http_port, record.metrics_port):
            self.ports.hold(port)
        log.info("LMCache server re-adopted", extra={"member": member, "pid": record.process.pid})

    async def stop_unnamed(self) -> None:
        """Stop every server hostd's own record names that it does not hold: nothing counts
        it."""
        for member, entry in list(self.kept.entries.items()):
            held = self.servers.get(member)
            if held is not None and held.record.process == entry.record.process:
                continue
            if procs.is_alive(entry.record.process):
                log.warning("%s: an LMCache server no record names; stopping it", member)
                await procs.stop_group(entry.record.process.pgid)
            self.kept.drop(member)
            if held is not None:
                self.kept.keep_server(held)
