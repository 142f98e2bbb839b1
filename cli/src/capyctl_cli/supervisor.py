"""supervisord for a role: its configuration, and a client for its state."""

from __future__ import annotations

import http.client
import shlex
import socket
import time
import xmlrpc.client
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from capycommon.paths import StatePaths

LOG_MAX = "16MB"
LOG_BACKUPS = 3


@dataclass(frozen=True)
class Program:
    name: str
    argv: list[str]
    priority: int
    stopwaitsecs: int
    # Quick exits in a row before supervisord gives the program up (FATAL). Services keep
    # trying while Redis is away; Redis itself gives up, so the launcher can say why.
    startretries: int = 1000
    # Exit codes after which the program stays down (a revoked host's services exit 14).
    final_exits: tuple[int, ...] = ()


def _restart(program: Program) -> str:
    if not program.final_exits:
        return "autorestart=true"
    # supervisord restarts on the codes not listed when told `unexpected`.
    listed = ",".join(str(code) for code in program.final_exits)
    return f"autorestart=unexpected\nexitcodes={listed}"


def _escape(value: str) -> str:
    # supervisord expands %(name)s in values; a literal percent sign is written %%.
    return value.replace("%", "%%")


def render(role: str, paths: StatePaths, programs: list[Program]) -> str:
    """A foreground supervisord that restarts any process that exits."""
    sections = [
        f"""[unix_http_server]
file={_escape(str(paths.supervisor_socket))}
chmod=0700

[supervisord]
nodaemon=true
silent=true
identifier=capyctl-{role}
logfile={_escape(str(paths.logs_dir / "supervisord.log"))}
logfile_maxbytes={LOG_MAX}
logfile_backups={LOG_BACKUPS}
pidfile={_escape(str(paths.run_dir / "supervisord.pid"))}
childlogdir={_escape(str(paths.logs_dir))}

[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface

[supervisorctl]
serverurl=unix://{_escape(str(paths.supervisor_socket))}
"""
    ]
    for program in programs:
        command = " ".join(shlex.quote(arg) for arg in program.argv)
        sections.append(
            f"""[program:{program.name}]
command={_escape(command)}
priority={program.priority}
autostart=true
{_restart(program)}
startsecs=1
startretries={program.startretries}
stopsignal=TERM
stopwaitsecs={program.stopwaitsecs}
stopasgroup=true
killasgroup=true
redirect_stderr=true
stdout_logfile={_escape(str(log_file(paths, program.name)))}
stdout_logfile_maxbytes={LOG_MAX}
stdout_logfile_backups={LOG_BACKUPS}
"""
        )
    return "\n".join(sections)


def log_file(paths: StatePaths, program: str) -> Path:
    return paths.logs_dir / f"{program}.log"


@dataclass(frozen=True)
class ProcessInfo:
    name: str
    state: str
    pid: int | None
    uptime_s: float | None
    exit_status: int | None


def processes(socket_path: Path, timeout: float = 5.0) -> list[ProcessInfo]:
    """What supervisord says of each process it runs. A supervisord that cannot say, because
    it is not listening or because it is shutting down (its SHUTDOWN_STATE fault), raises
    OSError alike: the callers ask again, or show the processes as unknown."""
    transport = _UnixTransport(socket_path, timeout)
    with xmlrpc.client.ServerProxy("http://localhost", transport=transport) as proxy:
        try:
            infos = cast(list[dict[str, Any]], proxy.supervisor.getAllProcessInfo())
        except xmlrpc.client.Fault as exc:
            raise ConnectionError(f"supervisord answered {exc.faultString}") from None
    now = time.time()
    result = []
    for info in infos:
        running = info["statename"] == "RUNNING"
        result.append(
            ProcessInfo(
                name=info["name"],
                state=info["statename"],
                pid=info["pid"] or None,
                uptime_s=now - info["start"] if running else None,
                exit_status=None if running else info["exitstatus"],
            )
        )
    return result


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = socket_path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(str(self.socket_path))
        except BaseException:
            sock.close()
            raise
        self.sock = sock


class _UnixTransport(xmlrpc.client.Transport):
    """XML-RPC to supervisord over its owner-only unix socket, with a timeout."""

    def __init__(self, socket_path: Path, timeout: float) -> None:
        super().__init__()
        self.socket_path = socket_path
        self.timeout = timeout

    def make_connection(self, host: Any) -> http.client.HTTPConnection:
        # Kept where the base class keeps it, so that its close (on a failed request, and
        # at the end of the proxy's `with`) closes the socket.
        connection = _UnixHTTPConnection(self.socket_path, self.timeout)
        self._connection = (host, connection)
        return connection
