"""`capyctl status`: the role running on a state dir, from supervisord and the heartbeats."""

from __future__ import annotations

import json
import time

import redis
from pydantic import BaseModel

from capycommon import heartbeats
from capycommon.errors import RoleNotRunning
from capycommon.paths import StatePaths
from capyctl_cli import output, supervisor
from capyctl_cli.launcher import lock_is_held


class ProcessStatus(BaseModel):
    name: str
    state: str
    pid: int | None
    uptime_s: float | None
    heartbeat_age_s: float | None
    heartbeat_pid: int | None
    version: str | None


class StatusReport(BaseModel):
    role: str
    version: str
    pid: int
    uptime_s: float
    state_dir: str
    document: str | None
    listeners: dict[str, str]
    redis: str
    processes: list[ProcessStatus]


def collect(paths: StatePaths) -> StatusReport:
    if not lock_is_held(paths):
        raise RoleNotRunning(
            f"no role is running on the state dir {paths.root}; start one with "
            "`capyctl start standalone`"
        )
    record = json.loads(paths.role_record.read_text())
    try:
        infos = {info.name: info for info in supervisor.processes(paths.supervisor_socket)}
    except OSError:
        infos = {}
    beats = _heartbeats(record)
    processes = []
    for name in record["processes"]:
        info = infos.get(name)
        beat = beats.get(name)
        processes.append(
            ProcessStatus(
                name=name,
                state=info.state if info else "UNKNOWN",
                pid=info.pid if info else None,
                uptime_s=info.uptime_s if info else None,
                heartbeat_age_s=round(heartbeats.age(beat), 1) if beat else None,
                heartbeat_pid=beat.pid if beat else None,
                version=beat.version if beat else None,
            )
        )
    return StatusReport(
        role=record["role"],
        version=record["version"],
        pid=record["pid"],
        uptime_s=time.time() - record["started_at"],
        state_dir=record["state_dir"],
        document=record["document"],
        listeners=record["listeners"],
        redis=record["redis_url"],
        processes=processes,
    )


def _heartbeats(record: dict[str, object]) -> dict[str, heartbeats.Heartbeat]:
    client = redis.Redis.from_url(
        str(record["redis_url"]), socket_timeout=2, socket_connect_timeout=2
    )
    services = [str(name) for name in record["processes"]]  # type: ignore[attr-defined]
    host = record.get("host")
    try:
        return heartbeats.read_all(client, str(host) if host else None, services)
    except (redis.RedisError, OSError):
        return {}
    finally:
        client.close()


def render(report: StatusReport) -> str:
    summary = [
        ("role", f"{report.role} (pid {report.pid}, up {output.duration(report.uptime_s)})"),
        ("version", report.version),
        ("state dir", report.state_dir),
        ("document", report.document),
        *[(name, f"http://{address}") for name, address in report.listeners.items()],
        ("redis", report.redis),
    ]
    rows = [
        (
            p.name,
            p.state,
            p.pid,
            output.duration(p.uptime_s),
            "-"
            if p.name == "redis"
            else (f"{p.heartbeat_age_s:.0f}s ago" if p.heartbeat_age_s is not None else "missing"),
        )
        for p in report.processes
    ]
    return (
        output.pairs(summary)
        + "\n\n"
        + output.table(["PROCESS", "STATE", "PID", "UPTIME", "HEARTBEAT"], rows)
    )
