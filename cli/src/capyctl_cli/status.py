"""`capyctl status`: the role running on a state dir, from supervisord and the heartbeats,
and its host's memory from memwatch's latest reading."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import redis
from pydantic import BaseModel, ValidationError

from capycommon.domain.hosts import Heartbeat
from capycommon.domain.leader import Lease, PlanTimes
from capycommon.domain.memory import MemoryReading
from capycommon.errors import RoleNotRunning
from capycommon.paths import StatePaths
from capycommon.state import heartbeats
from capycommon.state.leader import server_name
from capycommon.units import format_size
from capyctl_cli import output, record, replstatus, supervisor
from capyctl_cli.record import RoleRecord
from capyctl_cli.rolelock import lock_is_held

if TYPE_CHECKING:
    from collections.abc import Iterable

    from capycommon.state.stores import State

# The processes that run workers, each with its own heartbeat (`capyctl_router.workers`).
WORKERS_OF = frozenset({"router"})


class WorkerStatus(BaseModel):
    """A worker process of a service (the router's), as its heartbeat says: RUNNING while
    its pid lives, EXITED for a heartbeat left by a worker that died (until it expires)."""

    name: str
    state: str
    pid: int
    uptime_s: float
    heartbeat_age_s: float
    version: str


class ProcessStatus(BaseModel):
    name: str
    state: str
    pid: int | None
    uptime_s: float | None
    heartbeat_age_s: float | None
    heartbeat_pid: int | None
    version: str | None
    workers: list[WorkerStatus] = []


class GpuStatus(BaseModel):
    index: int
    uuid: str
    name: str
    unified: bool
    total_bytes: int
    used_bytes: int
    free_bytes: int


class RamStatus(BaseModel):
    source: str
    total_bytes: int
    used_bytes: int
    available_bytes: int


class HostMemory(BaseModel):
    """A host's memory as its latest reading says; stale or missing: unobserved, no figures."""

    host: str
    state: Literal["observed", "unobserved"]
    reading_age_s: float | None
    backend: str | None
    gpus: list[GpuStatus]
    ram: RamStatus | None


class LeaseStatus(BaseModel):
    """Which server's scheduler holds the scheduler lease, and since when."""

    server: str
    epoch: int
    since: float
    # Whether it is this role's own scheduler.
    here: bool


class StatusReport(BaseModel):
    role: str
    version: str
    pid: int
    uptime_s: float
    state_dir: str
    document: str | None
    listeners: dict[str, str]
    redis: str
    # Why Redis refuses writes (its disk is full, most often), or None while it saves.
    redis_refuses_writes: str | None = None
    processes: list[ProcessStatus]
    hosts: list[HostMemory]
    # None on a host (its user may not read it), or where nobody holds it.
    scheduler_lease: LeaseStatus | None = None
    # What the leader's planning ticks cost, as it last wrote (None on a host, or before).
    planning: PlanTimes | None = None
    # Replicated servers alone.
    replication: replstatus.ReplicationStatus | None = None


def collect(paths: StatePaths) -> StatusReport:
    if not lock_is_held(paths):
        raise RoleNotRunning(
            f"no role is running on the state dir {paths.root}; start one with "
            "`capyctl start standalone`"
        )
    found = record.read(paths)
    if found is None:
        raise RoleNotRunning(f"the role on {paths.root} left no readable {paths.role_record}")
    try:
        infos = {info.name: info for info in supervisor.processes(paths.supervisor_socket)}
    except OSError:
        infos = {}
    seen = _observe(found)
    processes = []
    for name in found.processes:
        info = infos.get(name)
        beat = seen.beats.get(name)
        processes.append(
            ProcessStatus(
                name=name,
                state=info.state if info else "UNKNOWN",
                pid=info.pid if info else None,
                uptime_s=info.uptime_s if info else None,
                heartbeat_age_s=round(heartbeats.age(beat), 1) if beat else None,
                heartbeat_pid=beat.pid if beat else None,
                version=beat.version if beat else None,
                workers=[_worker(beat) for _, beat in sorted(seen.workers.get(name, {}).items())],
            )
        )
    return StatusReport(
        role=found.role,
        version=found.version,
        pid=found.pid,
        uptime_s=time.time() - found.started_at,
        state_dir=found.state_dir,
        document=found.document,
        listeners=found.listeners,
        redis=found.redis_url,
        redis_refuses_writes=seen.refusal,
        processes=processes,
        hosts=seen.hosts,
        scheduler_lease=_lease(seen.lease, found.state_dir),
        planning=seen.planning,
        replication=seen.replication,
    )


Beats = dict[str, Heartbeat]


@dataclass
class Observed:
    """What status reads of the role's Redis."""

    beats: Beats = field(default_factory=dict)
    # Each service's workers' heartbeats.
    workers: dict[str, Beats] = field(default_factory=dict)
    hosts: list[HostMemory] = field(default_factory=list)
    # Why Redis refuses writes, if it does.
    refusal: str | None = None
    lease: Lease | None = None
    planning: PlanTimes | None = None
    replication: replstatus.ReplicationStatus | None = None


def _observe(running: RoleRecord) -> Observed:
    """The services' heartbeats, their workers', the role's host's memory, why Redis refuses
    writes if it does, and the scheduler lease, read from the role's Redis."""
    host = running.host
    readings: dict[str, MemoryReading | None] = {host: None} if host else {}
    seen = Observed()
    try:
        with record.state_of(running, timeout=2) as state:
            if running.role != "host":  # a host's own Redis user may ask neither
                seen.refusal = state(lambda s: s.persistence.save_failure())
                seen.lease = state(lambda s: s.leader.current())
                seen.planning = state(lambda s: s.leader.plan_times())
                seen.replication = replstatus.collect(StatePaths(Path(running.state_dir)), state)
            seen.beats = state(
                lambda s: s.heartbeats.of_services(host, running.processes, running.server)
            )
            seen.workers = state(
                lambda s: _workers(s, WORKERS_OF.intersection(running.processes), running.server)
            )
            if host:
                readings[host] = state(lambda s: s.memory.reading(host))
    except (redis.RedisError, OSError, ValidationError):
        pass  # what could not be read shows as missing or unobserved
    now = time.time()
    seen.hosts = [host_memory(name, found, now) for name, found in readings.items()]
    return seen


def _lease(lease: Lease | None, state_dir: str) -> LeaseStatus | None:
    if lease is None:
        return None
    here = lease.server == server_name(state_dir)
    return LeaseStatus(server=lease.server, epoch=lease.epoch, since=lease.since, here=here)


async def _workers(state: State, services: Iterable[str], server: str) -> dict[str, Beats]:
    """The live heartbeats of each of `services`' workers (on `server`), by service."""
    return {name: await state.heartbeats.workers(name, server) for name in services}


def _worker(beat: Heartbeat) -> WorkerStatus:
    return WorkerStatus(
        name=beat.service,
        state="RUNNING" if Path(f"/proc/{beat.pid}").exists() else "EXITED",
        pid=beat.pid,
        uptime_s=time.time() - beat.started_at,
        heartbeat_age_s=round(heartbeats.age(beat), 1),
        version=beat.version,
    )


def host_memory(host: str, reading: MemoryReading | None, now: float) -> HostMemory:
    """What status shows of a host's memory; a stale or missing reading is unobserved."""
    age = round(now - reading.taken_at, 1) if reading is not None else None
    if reading is None or not reading.is_fresh(now):
        return HostMemory(
            host=host, state="unobserved", reading_age_s=age, backend=None, gpus=[], ram=None
        )
    gpus = [GpuStatus.model_validate(gpu, from_attributes=True) for gpu in reading.gpus]
    ram = RamStatus(
        source=reading.ram.source,
        total_bytes=reading.ram.total_bytes,
        used_bytes=reading.ram.total_bytes - reading.ram.available_bytes,
        available_bytes=reading.ram.available_bytes,
    )
    return HostMemory(
        host=host, state="observed", reading_age_s=age, backend=reading.backend, gpus=gpus, ram=ram
    )


def render(report: StatusReport) -> str:
    summary = [
        ("role", f"{report.role} (pid {report.pid}, up {output.duration(report.uptime_s)})"),
        ("version", report.version),
        ("state dir", report.state_dir),
        ("document", report.document),
        *[(name, f"http://{address}") for name, address in report.listeners.items()],
        ("redis", report.redis),
    ]
    if report.redis_refuses_writes is not None:
        summary.append(("redis refuses writes", _refusal(report)))
    if report.role != "host":
        summary.append(("scheduler lease", _lease_line(report.scheduler_lease)))
        if report.planning is not None:
            summary.append(("planning", _planning_line(report.planning)))
    if report.replication is not None:
        summary += replstatus.render(report.replication)
    rows: list[tuple[object, ...]] = []
    for p in report.processes:
        rows.append((p.name, p.state, p.pid, output.duration(p.uptime_s), _heartbeat(p)))
        rows += [
            (f"  {w.name}", w.state, w.pid, output.duration(w.uptime_s), _age(w.heartbeat_age_s))
            for w in p.workers
        ]
    processes = output.table(["PROCESS", "STATE", "PID", "UPTIME", "HEARTBEAT"], rows)
    text = f"{output.pairs(summary)}\n\n{processes}"
    if report.hosts:
        text += "\n\n" + render_memory(report.hosts)
    return text


def _lease_line(lease: LeaseStatus | None) -> str:
    if lease is None:
        return "held by none (a scheduler takes it within seconds of starting)"
    whose = "this server" if lease.here else lease.server
    age = output.duration(time.time() - lease.since)
    return f"held by {whose} (epoch {lease.epoch}, for {age})"


def _planning_line(times: PlanTimes) -> str:
    return (
        f"a tick takes {times.p50_ms:g} ms (p50), {times.p99_ms:g} ms (p99), "
        f"{times.cpu_ms:g} ms of CPU, over its last {times.ticks} ticks"
    )


def _refusal(report: StatusReport) -> str:
    redis_dir = Path(report.state_dir) / "redis"
    free = format_size(shutil.disk_usage(redis_dir).free) if redis_dir.exists() else "?"
    return (
        f"{report.redis_refuses_writes} ({free} free in {redis_dir}); free space there and "
        "it takes writes again on its own"
    )


def _heartbeat(process: ProcessStatus) -> str:
    """How old a service's last heartbeat is; redis and sentinel, not services of ours, send
    none."""
    if process.name in ("redis", "sentinel"):
        return "-"
    return _age(process.heartbeat_age_s)


def _age(age: float | None) -> str:
    return "missing" if age is None else f"{age:.0f}s ago"


MEMORY_HEADERS = ["HOST", "MEMORY", "UUID", "TOTAL", "USED", "FREE", "SOURCE"]


def render_memory(hosts: list[HostMemory]) -> str:
    """One row per GPU and one for host RAM, per host; an unobserved host says so."""
    rows: list[tuple[object, ...]] = []
    for host in hosts:
        if host.state == "unobserved":
            age = host.reading_age_s
            seen = "no reading" if age is None else f"last reading {output.duration(age)} ago"
            rows.append((host.host, "unobserved", None, None, None, None, seen))
            continue
        for gpu in host.gpus:
            label = f"gpu {gpu.index} {gpu.name}" + (" (unified)" if gpu.unified else "")
            sizes = _sizes(gpu.total_bytes, gpu.used_bytes, gpu.free_bytes)
            rows.append((host.host, label, gpu.uuid, *sizes, host.backend))
        if host.ram is not None:
            ram = host.ram
            sizes = _sizes(ram.total_bytes, ram.used_bytes, ram.available_bytes)
            rows.append((host.host, "host RAM", None, *sizes, ram.source))
    return output.table(MEMORY_HEADERS, rows)


def _sizes(*values: int) -> tuple[str, ...]:
    return tuple(format_size(value) for value in values)
