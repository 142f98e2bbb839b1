"""Helpers for tests that run real processes (waiting on conditions, running roles and
services), and the engine profile that tests of several folders register."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis
import yaml

from capycommon.deployments import parse_deployment
from capycommon.domain.desired import DeploymentRecord
from capycommon.domain.instances import CacheRecord, InstanceRecord, InstanceState, ProcessIdentity
from capycommon.engines.families import Family
from capycommon.engines.registry import EngineProfile
from capycommon.errors import CapyError
from capycommon.paths import StatePaths
from capycommon.tasks import cancel_and_wait
from capyctl_cli import status
from ports import engine_ports, free_port

T = TypeVar("T")

BIN = Path(sys.executable).parent
CAPYCTL = str(BIN / "capyctl")
SERVICES = ("router", "scheduler", "hostd", "memwatch")


@contextlib.contextmanager
def ctrl_c_heard() -> Iterator[None]:
    """Children started within hear a Ctrl-C (SIGINT). A shell that runs the suite in the
    background leaves SIGINT ignored in it, and an ignored signal stays ignored in every
    child; a handled one is reset to its default in a child."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def poll(condition: Callable[[], T | None], timeout: float, interval: float = 0.1) -> T | None:
    """`condition`'s first truthy result, asked every `interval` s; None once `timeout` has
    passed without one. The one polling loop of the tests: they wait on conditions."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)
    return result


def wait_for(
    condition: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1
) -> T:
    """Poll `condition` until it returns something truthy; fail naming `what`."""
    result = poll(condition, timeout, interval)
    if result is None:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    return result


def holds_for(condition: Callable[[], object], seconds: float, what: str) -> None:
    """Check `condition` again and again for `seconds`; fail naming `what` the first time it
    does not hold (a watch over a span, where `wait_for` waits for a moment)."""
    if poll(lambda: not condition(), seconds):
        raise AssertionError(f"{what} stopped holding within {seconds} s")


async def cancel(task: asyncio.Task[Any]) -> None:
    """Cancel `task` (a request hung up, say) and return once it has ended; a failure of its
    own is raised. It is cancelled again while it runs on: on Python 3.11 a cancel can be
    lost inside redis-py's commands (`cancel_and_wait` says how), and a test that awaited it
    once waited forever."""
    await cancel_and_wait(task)
    if not task.cancelled() and (failure := task.exception()) is not None:
        raise failure


async def held_chat(
    http: httpx.AsyncClient, body: dict[str, Any], first: asyncio.Event | None = None
) -> None:
    """Send a chat completion and hold its connection until cancelled, as a client that then
    hangs up; `first` is set once the answer's first content came."""
    async with http.stream("POST", "/chat/completions", json=body) as response:
        async for line in response.aiter_lines():
            if first is not None and '"content"' in line:
                first.set()
        await asyncio.Event().wait()


async def wait_for_async(
    condition: Callable[[], Awaitable[T | None]],
    timeout: float,
    what: str,
    interval: float = 0.1,
) -> T:
    """`wait_for` for a condition read through an asyncio client: the event loop serves
    others between the polls."""
    try:
        async with asyncio.timeout(timeout):
            while not (result := await condition()):
                await asyncio.sleep(interval)
            return result
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None


def short_dir(prefix: str = "capy") -> Path:
    """A short temporary folder: unix socket paths must stay under 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}-", dir="/tmp"))


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without any CAPYCTL_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CAPYCTL_")}
    env.update(extra)
    return env


def capyctl(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CAPYCTL, *args],
        capture_output=True,
        text=True,
        env=env if env is not None else clean_env(),
        timeout=timeout,
        check=False,
    )


def run_python(
    *args: str, env: dict[str, str] | None = None, stdin: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """This interpreter run with `args` in a process of its own (with `env`, else ours, and
    `stdin` as its input), its output captured as text; whether it failed is the caller's to
    check."""
    return subprocess.run(
        [sys.executable, *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def service_command(service: str, state: Path) -> list[str]:
    """One service of a standalone role run on its own, as supervisord runs it."""
    return [
        sys.executable,
        "-m",
        f"capyctl_{service}",
        "--role",
        "standalone",
        "--state-dir",
        str(state),
    ]


def engine_profile(family: Family, name: str | None = None) -> EngineProfile:
    """A registered engine of `family` at a supported version, as found at /opt/<family>;
    named after its family unless `name` says otherwise. A custom one is an OpenAI-compatible
    server started from its command, with its key in CUSTOM_API_KEY."""
    versions = {
        Family.VLLM: "0.29.0",
        Family.SGLANG: "0.5.16",
        Family.LLAMACPP: "6500",
        Family.TENSORFOLD: "0.6.6",
        Family.CUSTOM: "2.4",
        Family.LMCACHE: "0.5.6",
    }
    version = versions[family]
    program = Path(f"/opt/{family}/bin/{'serve' if family == Family.CUSTOM else 'python'}")
    custom = family == Family.CUSTOM
    return EngineProfile(
        name=name or family.value,
        family=family,
        version=version,
        executable=program,
        install_path=Path(f"/opt/{family}"),
        fingerprint=f"{version}+sha256:" + "0" * 64,
        verified=False,
        added_at=datetime(2026, 11, 30, tzinfo=UTC),
        command=(str(program), "--port", "{port}", "--model", "{model}") if custom else (),
        ready_path="/ready" if custom else None,
        key_env="CUSTOM_API_KEY" if custom else None,
    )


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; it only waits to be reaped.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    pgid: int
    cmdline: str


def live_processes() -> list[ProcessInfo]:
    """Every live (non-zombie) process but this one, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            found.append(ProcessInfo(int(entry.name), int(fields[1]), int(fields[2]), cmdline))
    return found


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions `text` (used to prove nothing was left behind)."""
    return [p.pid for p in live_processes() if text in p.cmdline]


def group_members(pgid: int) -> list[int]:
    """Live processes of a process group."""
    return [p.pid for p in live_processes() if p.pgid == pgid]


def children_of(pid: int) -> list[int]:
    return [p.pid for p in live_processes() if p.ppid == pid]


@dataclass
class Role:
    """A `capyctl start <role>` process under test."""

    role: str
    state_dir: Path
    inference: str
    management: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    def capyctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return capyctl(*args, "--state-dir", str(self.state_dir), env=self.env)

    def status(self) -> dict[str, Any]:
        """What `capyctl status --json` prints, read in this process (tests poll it, and the
        command would keep a core busy importing itself); the command has tests of its own."""
        data: dict[str, Any] = status.collect(StatePaths(self.state_dir)).model_dump(mode="json")
        return data

    def processes(self) -> dict[str, dict[str, Any]]:
        return {p["name"]: p for p in self.status()["processes"]}

    def credentials(self) -> dict[str, str]:
        data: dict[str, str] = yaml.safe_load(
            (self.state_dir / "identity" / "credentials").read_text()
        )
        return data

    def control(self, **options: Any) -> redis.Redis:
        """The role's Redis on its unix socket, as the control plane's user; `options` go to
        the client (protocol=2, say)."""
        password = (self.state_dir / "identity" / "redis-password").read_text().strip()
        sock = self.state_dir / "redis" / "redis.sock"
        return redis.Redis(
            unix_socket_path=str(sock), username="capyctl", password=password, **options
        )

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        """Every process of the role RUNNING and every service's heartbeat written by its
        current pid. Read here as `capyctl status` reads it: polling the command itself
        would keep a core busy importing it while the role starts."""
        try:
            report = status.collect(StatePaths(self.state_dir))
        except (CapyError, OSError, redis.RedisError):
            return False
        for proc in report.processes:
            if proc.state != "RUNNING":
                return False
            # Redis and a replicated server's Sentinel are not ours: they send no heartbeat.
            if proc.name not in ("redis", "sentinel") and proc.heartbeat_pid != proc.pid:
                return False
        # A service beats before its listeners take connections: the API must answer too.
        listeners = (self.inference, self.management) if self.role != "host" else ()
        return bool(report.processes) and all(_accepts(address) for address in listeners)

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def start_role(
    role: str = "standalone",
    state_dir: Path | None = None,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    listeners: tuple[str, str] | None = None,
) -> Role:
    """Start a role and wait until it is healthy; on free ports unless `listeners` names its
    inference and management addresses (a restart keeps a role's)."""
    state = state_dir or short_dir() / "state"
    inference, management = listeners or (f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    log_path = state.parent / f"{role}.out"
    env = env if env is not None else clean_env()
    if "--engine-ports" not in extra and "CAPYCTL_ENGINE_PORTS" not in env:
        env = {**env, "CAPYCTL_ENGINE_PORTS": engine_ports()}
    if role == "server" and "--enrollment-control-bind" not in extra:
        # Where joined hosts reach the server: free ports too, so servers run side by side.
        extra = (
            "--enrollment-control-bind",
            f"127.0.0.1:{free_port()}",
            "--enrollment-bootstrap-bind",
            f"127.0.0.1:{free_port()}",
            *extra,
        )
    if role != "server" and "--host-name" not in extra and "CAPYCTL_HOST_NAME" not in env:
        # The tests know the host as `local`; a role is named after the machine otherwise.
        extra = ("--host-name", "local", *extra)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                CAPYCTL,
                "start",
                role,
                "--state-dir",
                str(state),
                "--listen",
                inference,
                "--management-listen",
                management,
                *extra,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    handle = Role(role, state, inference, management, proc, log_path, env)
    try:
        wait_for(
            lambda: handle.healthy() or (proc.poll() is not None and _failed(handle)),
            timeout=90,  # a deadline, not a wait: a loaded machine starts a role slowly
            what=f"the {role} role to be healthy",
        )
    except BaseException:
        handle.stop()
        raise
    return handle


def _accepts(address: str) -> bool:
    """Whether something listens on HOST:PORT."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def role_running(role: str = "standalone", env: dict[str, str] | None = None) -> Iterator[Role]:
    """A role of its own folder for the length of a `with`: stopped, and its folder removed,
    on leaving it."""
    handle = start_role(role, env=env)
    try:
        yield handle
    finally:
        handle.stop()
        shutil.rmtree(handle.state_dir.parent, ignore_errors=True)


def _failed(handle: Role) -> bool:
    raise AssertionError(f"the role exited with {handle.proc.returncode}:\n{handle.output()}")


def redis_server(folder: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A real redis-server on `folder`/redis.sock (owner-only, no TCP port, no snapshots),
    with `extra` settings; returned once its socket is there."""
    server = shutil.which("redis-server")
    assert server is not None, "redis-server is not installed; run scripts/setup"
    sock = folder / "redis.sock"
    sock.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            server,
            "--port",
            "0",
            "--unixsocket",
            str(sock),
            "--unixsocketperm",
            "700",
            "--dir",
            str(folder),
            "--save",
            "",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(sock.exists, timeout=10, what="redis-server's socket")
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def join_host(server: Role, name: str, state: Path, *extra: str) -> Path:
    """Invite host `name` on `server` and join it from `state`; the join file's path."""
    join_file = state.parent / f"{name}.join"
    join_file.unlink(missing_ok=True)
    invited = server.capyctl("invite", "host", name, "--output", str(join_file), *extra)
    assert invited.returncode == 0, invited.stderr
    recover = ("--recover",) if "--recover" in extra else ()
    joined = capyctl(
        "join", "host", "--join-file", str(join_file), "--state-dir", str(state), *recover
    )
    assert joined.returncode == 0, joined.stderr
    return join_file


def join_hosts(server: Role, root: Path, *names: str) -> None:
    """Hosts `names` joined to `server`, each with its state in `root/<name>/state`."""
    for name in names:
        (root / name).mkdir()
        join_host(server, name, root / name / "state")


def join_with_engines(server: Role, name: str, home: Path, engines: dict[str, Path]) -> Path:
    """Host `name` joined to `server`, its HOME at `home` (made here) and its state in
    `home/state`, with each of `engines` (name: install) added; the state folder."""
    state = home / "state"
    home.mkdir(parents=True)
    join_host(server, name, state)
    env = clean_env(HOME=str(home))
    for engine, path in engines.items():
        added = capyctl(
            "engine", "add", str(path), "--name", engine, "--state-dir", str(state), env=env
        )
        assert added.returncode == 0, added.stderr
    return state


def start_host(
    state: Path,
    gpus: str = "gpu0:24GiB",
    engine_range: int = 1,
    wait: bool = True,
    env: dict[str, str] | None = None,
) -> Role:
    """Start a joined host's role on simulated GPUs, its ingress on a free loopback port
    (`env["CAPYCTL_HOST_INGRESS_BIND"]`), with `env` on top; wait until its agents beat in
    the server's Redis (unless not `wait`)."""
    log_path = state.parent / f"host-{state.name}.out"
    env = clean_env(
        CAPYCTL_SIMULATED_GPUS=gpus,
        CAPYCTL_SIMULATED_HOST_RAM="64GiB",
        CAPYCTL_ENGINE_PORTS=engine_ports(engine_range),
        CAPYCTL_MODELS_ROOT=str(state.parent / "models"),
        CAPYCTL_HOST_INGRESS_BIND=f"127.0.0.1:{free_port()}",
    ) | (env or {})
    (state.parent / "models").mkdir(exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [CAPYCTL, "start", "host", "--state-dir", str(state)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    handle = Role("host", state, "", "", proc, log_path, env)
    if wait:
        try:
            wait_for(
                lambda: handle.healthy() or (proc.poll() is not None and _failed(handle)),
                timeout=30,
                what="the host's agents to beat in the server's Redis",
            )
        except BaseException:
            handle.stop()
            raise
    return handle


def cache_record(**changes: Any) -> CacheRecord:
    """An LMCache server beside an instance as hostd records it: a 4 GiB pool, charged 6 GiB
    of host RAM and 1 GiB on its GPU."""
    values: dict[str, Any] = {
        "profile": "lmcache",
        "version": "0.5.6",
        "fingerprint": "0.5.6+sha256:0",
        "revision": 1,
        "zmq_port": 8150,
        "http_port": 8151,
        "metrics_port": 8152,
        "pool_bytes": 4 << 30,
        "process": ProcessIdentity(pid=4242, pgid=4242, start_ticks=1),
        "host_bytes": 6 << 30,
        "device_bytes": 1 << 30,
    }
    return CacheRecord(**{**values, **changes})


def instance_record(deployment: str, host: str, **changes: Any) -> InstanceRecord:
    """Instance 0 of the deployment's first revision and generation on `host`, READY since
    now, as hostd records it; `changes` set any other field."""
    values: dict[str, Any] = {
        "deployment": deployment,
        "instance": 0,
        "revision": 1,
        "generation": 1,
        "state": InstanceState.READY,
        "since": time.time(),
        "host": host,
    }
    return InstanceRecord(**{**values, **changes})


def deployment_record(name: str, **document: Any) -> DeploymentRecord:
    """Revision 1, generation 1 of a vLLM deployment of the model `name`, as the scheduler
    records it; `document` adds fields to its document (or replaces them)."""
    values: dict[str, Any] = {
        "name": name,
        "revision": 1,
        "digest": "sha256:x",
        "created_at": 0.0,
        "updated_at": 0.0,
        "generation": 1,
    }
    parsed = parse_deployment({"name": name, "engine": "vllm", "model": name, **document}, "test")
    return DeploymentRecord(**values, document=parsed)
