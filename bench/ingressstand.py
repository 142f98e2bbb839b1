"""The ingress benchmark's stand: a standalone role and a server role with one joined host
whose ingress listens on 127.0.0.2, each serving one deployment of the engine simulator, for
`bench/ingress.py` to time side by side."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import redis.asyncio as aioredis
import yaml

import benchclient
import benchrole
import routerrole
from benchrole import GiB
from capycommon.paths import StatePaths
from capycommon.redistarget import CONTROL_USER
from capycommon.state.stores import Blocking
from capyctl_cli.gpucheck.role import end_left_under, stop_group

DEPLOYMENT = "bench"
JOINED = "gpu-a"  # the joined host's name
LOCAL = "local"  # the standalone role's host name
INGRESS_ADDRESS = "127.0.0.2"
MODEL_SIZE = 2 * GiB
DOCUMENT = {
    "name": DEPLOYMENT,
    "engine": "vllm",
    "model": DEPLOYMENT,
    "engine_config": {"memory": {"request": "6GiB"}},
}
KINDS = {"chat": benchclient.SHORT, "stream": benchclient.SHORT_STREAM}
# (row, kind, timed to the first token rather than the last byte)
ROWS = (
    ("chat, not streamed", "chat", False),
    ("streamed, first token", "stream", True),
    ("streamed, last byte", "stream", False),
)
WARM = 20  # requests a side and kind before each round's timed ones
STOP_S = 60.0


# The roles -----------------------------------------------------------------------------------


@dataclass
class Role:
    """A role this bench started, in a session of its own (Ctrl-C reaches only the bench,
    which stops the role in order)."""

    name: str
    state: Path
    env: dict[str, str]  # for the CLI against it
    process: subprocess.Popen[bytes]
    log: IO[bytes]
    port: int  # its inference port (0: a host role has none)

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return benchrole.cli(self.state, self.env, *args, check=check)

    def pids(self, service: str) -> list[int]:
        """The service's process and its workers, as `capyctl status --json` names them."""
        status = json.loads(self.cli("status", "--json", check=True).stdout)
        found: set[int] = set()
        for process in status["processes"]:
            if process["name"] == service and process["pid"]:
                found.add(process["pid"])
                found.update(worker["pid"] for worker in process.get("workers", []))
        return sorted(found)

    def api_key(self) -> str:
        credentials = yaml.safe_load((self.state / "identity" / "credentials").read_text())
        return str(credentials["api_key"])

    def engine(self, host: str) -> benchclient.Engine:
        """The deployment's engine on `host`, from the role's Redis."""
        paths = StatePaths(self.state)
        password = None
        if paths.redis_password.exists():
            password = paths.redis_password.read_text().strip()
        client = aioredis.Redis(
            unix_socket_path=str(paths.redis_socket),
            username=CONTROL_USER if password else None,
            password=password,
        )
        with Blocking(client) as blocking:
            record = blocking(lambda s: s.instances(host).get(DEPLOYMENT, 0))
            secret = blocking(lambda s: s.instances(host).secret(DEPLOYMENT, 0))
        if record is None or record.port is None or record.process is None or not secret:
            raise SystemExit(f"the {self.name} role's {DEPLOYMENT} has no engine on {host}")
        model = record.served_name or DEPLOYMENT
        process = record.process
        return benchclient.Engine(record.port, secret, model, process.pid, process.pgid)

    def deploy(self, folder: Path) -> None:
        """Deploy `bench` and start it, waiting until it serves."""
        document = folder / f"{DEPLOYMENT}.yaml"
        document.write_text(yaml.safe_dump(DOCUMENT))
        self.cli("deploy", "model", "--file", str(document), check=True)
        self.cli("start", "deployment", DEPLOYMENT, "--wait", "--timeout", "180", check=True)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its process group after STOP_S."""
        stop_group(self.process, STOP_S)
        self.log.close()


def _start(
    role: str,
    folder: Path,
    flags: Sequence[str],
    cli_env: dict[str, str],
    port: int = 0,
    settings: dict[str, str] | None = None,
) -> Role:
    """`capyctl start <role>` with its state dir in `folder`, its output in `folder`/role.log
    and `flags`, listening for inference on `port`; `settings` are CAPYCTL_ variables for the
    role alone."""
    log = (folder / "role.log").open("wb")
    state = folder / "state"
    process = subprocess.Popen(
        [*benchrole.CAPYCTL, "start", role, "--state-dir", str(state), *flags],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**cli_env, **(settings or {})},
        start_new_session=True,
    )
    return Role(role, state, cli_env, process, log, port)


def start_server(folder: Path, kept: dict[str, Role]) -> Role:
    """A server role in `folder` (made here), kept in `kept` as soon as it starts, returned
    once it answers."""
    folder.mkdir()
    port = benchrole.free_port()
    flags = ["--listen", f"127.0.0.1:{port}"]
    for flag in ("--management-listen", "--enrollment-control-bind"):
        flags += [flag, f"127.0.0.1:{benchrole.free_port()}"]
    flags += ["--enrollment-bootstrap-bind", f"127.0.0.1:{benchrole.free_port()}"]
    server = _start("server", folder, flags, benchrole.role_env(folder), port)
    kept["server"] = server
    _wait(server, lambda: server.cli("list", "hosts").returncode == 0, "the server role")
    return server


def _wait(role: Role, check: Callable[[], object], what: str, seconds: float = 120) -> None:
    """Wait for `check()`, failing early with the role's log when the role exits."""
    deadline = time.monotonic() + seconds
    while not check():
        if role.process.poll() is not None:
            log = (role.state.parent / "role.log").read_text(errors="replace")[-2000:]
            raise SystemExit(f"the {role.name} role exited with {role.process.returncode}:\n{log}")
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(0.2)


def _engine_ports() -> tuple[str, str]:
    """Two ranges of ten engine ports, free now, below the kernel's ephemeral ports and apart
    from the roles' default range and the tests' (engines bind SO_REUSEPORT: another's engine
    on the same port would take half of its connections)."""
    for _ in range(100):
        start = random.randrange(30_000, 32_000, 20)
        try:
            for port in range(start, start + 20):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return f"{start}-{start + 9}", f"{start + 10}-{start + 19}"
    raise SystemExit("found no 20 free ports in 30000-32000 for the engines")


class Stand:
    """The standalone role, the server role and its joined host, each with `bench` ready.
    Every role is kept as soon as it starts, so that `close` stops whatever was started."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.roles: dict[str, Role] = {}
        self.engines: dict[str, benchclient.Engine] = {}

    def start(self) -> None:
        local_ports, host_ports = _engine_ports()
        local = self.root / "local"
        document = benchrole.write_document(local, "64GiB", engine_ports=local_ports)
        venv = benchrole.install_vllm(self.root, document.parent, "vllm", routerrole.INSTANT)
        benchrole.sparse_model(local / "models" / DEPLOYMENT, MODEL_SIZE)
        log = (local / "role.log").open("wb")
        env = benchrole.role_env(local)
        port = benchrole.free_port()
        process = benchrole.start_standalone(
            local / "state", document, f"127.0.0.1:{port}", log, env, LOCAL, new_session=True
        )
        standalone = Role("standalone", local / "state", env, process, log, port)
        self.roles["local"] = standalone
        server = self._server()
        self._join(server, venv, host_ports)
        _wait(server, lambda: _host_ready(server), f"host {JOINED} ready with its engine")
        _wait(
            standalone,
            lambda: standalone.cli("list", "deployments").returncode == 0,
            "the standalone role",
        )
        standalone.deploy(local)
        server.deploy(server.state.parent)
        self.engines = {"local": standalone.engine(LOCAL), "host": server.engine(JOINED)}

    def _server(self) -> Role:
        return start_server(self.root / "server", self.roles)

    def _join(self, server: Role, venv: Path, ports: str) -> None:
        """Invite and join the host, register the engine install and the model there, and
        start it with its ingress on INGRESS_ADDRESS."""
        folder = self.root / "host"
        folder.mkdir()
        join_file = folder / "host.join"
        server.cli("invite", "host", JOINED, "--output", str(join_file), check=True)
        env = benchrole.role_env(folder)
        state = folder / "state"
        benchrole.cli(state, env, "join", "host", "--join-file", str(join_file), check=True)
        benchrole.cli(state, env, "engine", "add", str(venv), "--name", "vllm", check=True)
        benchrole.sparse_model(folder / "models" / DEPLOYMENT, MODEL_SIZE)
        settings = {
            "CAPYCTL_SIMULATED_GPUS": "gpu0:24GiB",
            "CAPYCTL_SIMULATED_HOST_RAM": "64GiB",
            "CAPYCTL_ENGINE_PORTS": ports,
            "CAPYCTL_MODELS_ROOT": str(folder / "models"),
            "CAPYCTL_HOST_INGRESS_BIND": f"{INGRESS_ADDRESS}:{benchrole.free_port()}",
        }
        self.roles["host"] = _start("host", folder, [], env, settings=settings)

    def targets(self) -> dict[str, benchclient.Target]:
        local, host = self.engines["local"], self.engines["host"]
        server, standalone = self.roles["server"], self.roles["local"]
        return {
            "engine local": benchclient.Target("engine local", local.port, local.key, local.model),
            "engine host": benchclient.Target("engine host", host.port, host.key, host.model),
            "router local": benchclient.Target(
                "router local", standalone.port, standalone.api_key(), DEPLOYMENT
            ),
            "router ingress": benchclient.Target(
                "router ingress", server.port, server.api_key(), DEPLOYMENT
            ),
        }

    def close(self) -> None:
        """Stop the engines (a role's stop leaves them running) through their roles, those
        still there after STOP_S with their process groups; then the roles, the host before
        its server; then anything still running from the run's folder."""
        for name, drain in (("local", ("standalone",)), ("server", ("host", JOINED))):
            if name in self.roles:
                with contextlib.suppress(subprocess.SubprocessError):
                    self.roles[name].cli("drain", *drain)
        deadline = time.monotonic() + STOP_S
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.2)
        for engine in self._running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.pgid, signal.SIGKILL)
        for name in ("host", "server", "local"):
            if name in self.roles:
                self.roles[name].stop()
        left = end_left_under(self.root)
        if left:
            print(f"killed {len(left)} processes still running from {self.root}: {left}")

    def tracebacks(self) -> int:
        logs = (log for role in self.roles.values() for log in (role.state / "logs").glob("*.log"))
        return sum(log.read_text(errors="replace").count("Traceback") for log in logs)

    def _running(self) -> list[benchclient.Engine]:
        return [e for e in self.engines.values() if Path(f"/proc/{e.pid}").exists()]


def _host_ready(server: Role) -> bool:
    found = server.cli("list", "hosts", "--json")
    if found.returncode:
        return False
    rows = {row["name"]: row for row in json.loads(found.stdout)}
    row = rows.get(JOINED)
    return bool(row and row["state"] == "ready" and "vllm" in row["engines"])
