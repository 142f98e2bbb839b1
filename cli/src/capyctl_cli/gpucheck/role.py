"""The standalone role the check runs: `capyctl start standalone` of this very capyctl
(`python -m capyctl_cli`, from a clone's .venv or a release executable alike) on a state dir
in the check's temporary folder, with its own role document, and its inference and
management listeners on ports the system chose, held by bound sockets until the role has
bound them (never found free and let go: another process could take one meanwhile).

The role's environment is the caller's without any CAPYCTL_* variable (so a setting of the
caller's role cannot leak in), with HOME in the folder, plus what the check adds. Whatever a
failed step leaves running (an engine outlives its role by design) is ended at the close by
PID: every process whose command line names the check's folder.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis
import yaml

from capycommon.errors import CapyError
from capycommon.paths import StatePaths
from capyctl_cli import status
from capyctl_cli.gpucheck.report import Fail
from capyctl_cli.management import Management
from capyctl_cli.status import StatusReport

T = TypeVar("T")
HOST = "gpucheck"
DOCUMENT = "standalone.yaml"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


def until(condition: Callable[[], T | None], timeout: float, what: str, every: float = 0.1) -> T:
    """Ask `condition` until it answers; Fail naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while (found := condition()) is None or found is False:
        if time.monotonic() > deadline:
            raise Fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
    return found


def hold_port() -> socket.socket:
    """A loopback port the system chose, held by a socket bound to it and never listening:
    the role binds it beside that socket (SO_REUSEADDR), nobody else can meanwhile."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def role_env(folder: Path, extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    (folder / "home").mkdir(parents=True, exist_ok=True)
    return {**env, "HOME": str(folder / "home"), **extra}


def write_document(folder: Path, server: Mapping[str, Any] | None = None) -> Path:
    """The role document, in `<folder>/config` (where an engine registry goes beside it)."""
    config = folder / "config"
    config.mkdir(parents=True, exist_ok=True, mode=0o700)
    document = {
        "kind": "standalone",
        "host": {"name": HOST, "models_root": str(folder / "models")},
        "server": dict(server or {}),
    }
    path = config / DOCUMENT
    path.write_text(yaml.safe_dump(document))
    return path


@dataclass
class Role:
    folder: Path
    proc: subprocess.Popen[bytes]
    inference: str
    management: str

    @property
    def paths(self) -> StatePaths:
        return StatePaths(self.folder / "state")

    @property
    def log(self) -> Path:
        return self.folder / "role.log"

    @classmethod
    def start(cls, folder: Path, env: Mapping[str, str] | None = None) -> Role:
        """The role on `<folder>/state` with `<folder>/config/standalone.yaml` (written by
        `write_document` first), once it is healthy and memwatch has read the host."""
        held = [hold_port(), hold_port()]
        inference, management = (f"127.0.0.1:{s.getsockname()[1]}" for s in held)
        argv = [sys.executable, "-m", "capyctl_cli", "start", "standalone"]
        argv += [
            "--state-dir",
            str(folder / "state"),
            "--config",
            str(folder / "config" / DOCUMENT),
        ]
        argv += ["--listen", inference, "--management-listen", management]
        with (folder / "role.log").open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=role_env(folder, env or {}),
                start_new_session=True,  # a Ctrl-C of the check reaches the check alone
            )
        role = cls(folder, proc, inference, management)
        try:
            until(role.healthy, START_TIMEOUT_S, "the standalone role to be healthy", 0.25)
        except BaseException:
            role.stop()
            raise
        finally:
            for sock in held:
                sock.close()
        return role

    def healthy(self) -> StatusReport | None:
        """The role's status once every process runs, each service has beaten, the API
        answers and memwatch's reading of the host is fresh; Fail once the role exited."""
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise Fail(f"the role exited {self.proc.returncode}: {' | '.join(tail)}")
        try:
            report = status.collect(self.paths)
        except (CapyError, OSError, redis.RedisError):
            return None
        for proc in report.processes:
            beaten = proc.name == "redis" or proc.heartbeat_pid == proc.pid
            if proc.state != "RUNNING" or not beaten:
                return None
        if not report.processes or any(h.state != "observed" for h in report.hosts):
            return None
        try:
            with self.api() as api:
                api.health()
        except CapyError:
            return None
        return report

    def api(self) -> Management:
        return Management(self.paths, timeout=30)

    def stop(self) -> float:
        """Stop the role (SIGTERM, then its process group killed past the timeout); the
        seconds it took."""
        started = time.monotonic()
        stop_group(self.proc, STOP_TIMEOUT_S)
        return time.monotonic() - started


def stop_group(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM to `proc`, then SIGKILL to its process group once `timeout` seconds passed;
    returns when `proc` has exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def end_left_under(folder: Path) -> list[int]:
    """SIGKILL every process whose command line names `folder`, by PID; the PIDs ended."""
    ended = []
    mark = str(folder).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if mark in cmdline:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                ended.append(int(entry.name))
    return ended
