"""What a joined host's ingress adds to a request: a server's router reaching an engine
through the host's ingress (hostd, over mutual TLS), against a standalone role's router
reaching its own engine on loopback, measured side by side in one run on this machine.

Starts, in a temporary folder, a standalone role and a server role with one joined host
whose ingress listens on 127.0.0.2. Each serves one deployment, `bench`, of one install of
the engine simulator as vLLM in its instant mode (the whole answer ready at once, served on
the simulator's lean path: well under a millisecond a request), on a model of the same size,
started (`capyctl start deployment bench --wait`) before anything is timed. The sides, all
driven by the lean client of bench/router.py (keep-alive connections, warmed up):

  engine local / engine host   straight to each engine's port with its per-launch key: the
                               floor, and a check that the two engines answer alike
  router local                 the standalone role's router, to its engine on loopback
  router ingress               the server's router, through the host's ingress, to the
                               host's engine

At concurrency 1, each round sends --requests short chats (max_tokens 8) of each kind (not
streamed, streamed) a side, interleaved request by request (the sides' order turning at each
request), so that the machine's other load falls on every side alike. It prints p50 and p99
(not streamed; streamed to the first token and to the last byte), what the ingress adds
(router ingress - router local) and the ratio (router ingress / router local), the added p50
round by round, and the CPU each process spent a request. Then, at --concurrency (0 leaves
it out), short chats a second through each side for --seconds a side in each round.

    .venv/bin/python bench/ingress.py [--rounds N] [--requests N] [--concurrency N]
        [--seconds S] [--keep]

Every process it starts (the roles, their engines) is stopped and its folder removed at the
end, on a failure, Ctrl-C or SIGTERM too (--keep keeps the folder and the roles' logs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

import redis
import yaml

import benchclient
import benchrole
import router
import routerrole
from benchrole import GiB
from capycommon.paths import StatePaths
from capycommon.redistarget import CONTROL_USER
from capycommon.state import keys
from capycommon.state.instances import InstanceRecord

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
        with redis.Redis(
            unix_socket_path=str(paths.redis_socket),
            username=CONTROL_USER if password else None,
            password=password,
        ) as client:
            raw: bytes | None = client.get(keys.instance(host, DEPLOYMENT, 0))
            secret: bytes | None = client.get(keys.instance_secret(host, DEPLOYMENT, 0))
        record = None if raw is None else InstanceRecord.model_validate_json(raw)
        if record is None or record.port is None or record.process is None or not secret:
            raise SystemExit(f"the {self.name} role's {DEPLOYMENT} has no engine on {host}")
        model = record.served_name or DEPLOYMENT
        process = record.process
        return benchclient.Engine(record.port, secret.decode(), model, process.pid, process.pgid)

    def deploy(self, folder: Path) -> None:
        """Deploy `bench` and start it, waiting until it serves."""
        document = folder / f"{DEPLOYMENT}.yaml"
        document.write_text(yaml.safe_dump(DOCUMENT))
        self.cli("deploy", "model", "--file", str(document), check=True)
        self.cli("start", "deployment", DEPLOYMENT, "--wait", "--timeout", "180", check=True)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to its process group after STOP_S."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
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
        folder = self.root / "server"
        folder.mkdir()
        port = benchrole.free_port()
        flags = ["--listen", f"127.0.0.1:{port}"]
        for flag in ("--management-listen", "--enrollment-control-bind"):
            flags += [flag, f"127.0.0.1:{benchrole.free_port()}"]
        flags += ["--enrollment-bootstrap-bind", f"127.0.0.1:{benchrole.free_port()}"]
        server = _start("server", folder, flags, benchrole.role_env(folder), port)
        self.roles["server"] = server
        _wait(server, lambda: server.cli("list", "hosts").returncode == 0, "the server role")
        return server

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
        left = _kill_mentioning(self.root)
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


def _kill_mentioning(root: Path) -> list[int]:
    """SIGKILL every process whose command line names `root`: an engine whose record the
    bench never read (it was stopped while the engine started), or a role's child left."""
    mark, killed = str(root).encode(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            named = mark in (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if named:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


# Latency at concurrency 1 --------------------------------------------------------------------


@dataclass
class Side:
    """One side's requests and their replies, round by round."""

    target: benchclient.Target
    sent: int = 0  # warm-ups included
    replies: dict[str, list[list[benchclient.Reply]]] = field(default_factory=dict)

    def seconds(self, kind: str, first: bool, rounds: slice = slice(None)) -> list[float]:
        return [
            reply.first_token_s if first else reply.last_byte_s
            for each in self.replies[kind][rounds]
            for reply in each
        ]


async def _round(sides: list[Side], requests: int) -> None:
    """WARM then `requests` requests of each kind a side, one at a time, each side on its own
    keep-alive connection; the sides' order turns at each request."""
    connections = [benchclient.Connection(side.target.port) for side in sides]
    wire = [{kind: side.target.request(body) for kind, body in KINDS.items()} for side in sides]
    for side in sides:
        for kind in KINDS:
            side.replies.setdefault(kind, []).append([])
    try:
        for i in range(WARM + requests):
            turn = [*range(i % len(sides), len(sides)), *range(i % len(sides))]
            for kind in KINDS:
                for n in turn:
                    reply = await connections[n].send(wire[n][kind])
                    if not benchclient.ended_well(reply, kind == "stream"):
                        said = reply.body[:300].decode(errors="replace")
                        raise SystemExit(f"{sides[n].target.name}: {reply.status} {said}")
                    sides[n].sent += 1
                    if i >= WARM:
                        sides[n].replies[kind][-1].append(reply)
    finally:
        for connection in connections:
            connection.close()


async def _first_answer(target: benchclient.Target, seconds: float = 30) -> None:
    """Wait until `target` answers a short chat: a server's router learns of the host's
    ingress a moment after the deployment is ready."""
    deadline = time.monotonic() + seconds
    while True:
        connection = benchclient.Connection(target.port)
        try:
            reply = await connection.send(target.request(benchclient.SHORT))
            if benchclient.ended_well(reply, False):
                return
            said = f"{reply.status} {reply.body[:300].decode(errors='replace')}"
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            said = repr(exc)
        finally:
            connection.close()
        if time.monotonic() > deadline:
            raise SystemExit(f"{target.name} does not answer: {said}")
        await asyncio.sleep(0.2)


@dataclass
class Cpu:
    """CPU seconds of groups of processes, from /proc."""

    pids: dict[str, list[int]]
    start: dict[str, float] = field(default_factory=dict)

    def read(self) -> dict[str, float]:
        return {
            name: sum(benchclient.cpu_seconds(pid) for pid in pids)
            for name, pids in self.pids.items()
        }

    def used(self) -> dict[str, float]:
        now = self.read()
        return {name: now[name] - self.start[name] for name in now}


def latency(stand: Stand, rounds: int, requests: int) -> None:
    """The four sides at concurrency 1, interleaved, with the CPU each process spent."""
    sides = {name: Side(target) for name, target in stand.targets().items()}
    cpu = Cpu(
        {
            "router (standalone)": stand.roles["local"].pids("router"),
            "router (server)": stand.roles["server"].pids("router"),
            "hostd (the ingress)": stand.roles["host"].pids("hostd"),
            "engine local": [stand.engines["local"].pid],
            "engine host": [stand.engines["host"].pid],
        }
    )
    cpu.start = cpu.read()
    order = list(sides.values())
    for r in range(rounds):
        random.shuffle(order)  # which side starts the round's turns
        asyncio.run(_round(order, requests))
        print(f"  round {r + 1} of {rounds} done", flush=True)
    used = cpu.used()
    _show_latency(sides, rounds, requests)
    served = {
        "router (standalone)": sides["router local"].sent,
        "router (server)": sides["router ingress"].sent,
        "hostd (the ingress)": sides["router ingress"].sent,
        "engine local": sides["router local"].sent + sides["engine local"].sent,
        "engine host": sides["router ingress"].sent + sides["engine host"].sent,
    }
    print("  CPU a request (their background work included):")
    for name, seconds in used.items():
        print(f"    {name:<22}{seconds / served[name] * 1e6:>8.0f} us ({served[name]} requests)")


def _show_latency(sides: dict[str, Side], rounds: int, requests: int) -> None:
    def ms(name: str, kind: str, first: bool, p: float, which: slice = slice(None)) -> float:
        return benchclient.pct(sides[name].seconds(kind, first, which), p) * 1000

    print(
        f"\nlatency at concurrency 1, ms ({rounds * requests} requests a row and side, in "
        f"{rounds} rounds, interleaved request by request)"
    )
    print(f"  {'':<28}{'engine':>9}{'engine':>9}{'router':>9}{'router':>9}{'ingress':>9}")
    print(f"  {'':<28}{'local':>9}{'host':>9}{'local':>9}{'ingress':>9}{'adds':>9}{'ratio':>8}")
    for label, kind, first in ROWS:
        for p_name, p in (("p50", 0.5), ("p99", 0.99)):
            row = [ms(name, kind, first, p) for name in sides]
            added, ratio = row[3] - row[2], row[3] / row[2]
            cells = "".join(f"{v:>9.3f}" for v in row)
            print(f"  {label + ' ' + p_name:<28}{cells}{added:>9.3f}{ratio:>8.2f}")
    for label, kind, first in ROWS:
        per_round = [
            ms("router ingress", kind, first, 0.5, slice(r, r + 1))
            - ms("router local", kind, first, 0.5, slice(r, r + 1))
            for r in range(rounds)
        ]
        shown = ", ".join(f"{v:.3f}" for v in per_round)
        print(f"  the ingress adds at p50 by round, {label}: {shown}")


# Capacity ------------------------------------------------------------------------------------


def capacity(stand: Stand, concurrency: int, seconds: float, rounds: int) -> None:
    """Short chats a second at `concurrency`, a side at a time for `seconds`, the sides'
    order turning each round."""
    targets = stand.targets()
    sides = [targets["engine host"], targets["router local"], targets["router ingress"]]
    rates: dict[str, list[float]] = {side.name: [] for side in sides}
    failed: dict[str, int] = dict.fromkeys(rates, 0)
    for r in range(rounds):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
            ok, bad = asyncio.run(router._load(side, benchclient.SHORT, concurrency, seconds))
            rates[side.name].append(ok / seconds)
            failed[side.name] += bad
    mean = {name: statistics.mean(values) for name, values in rates.items()}
    print(
        f"\ncapacity at concurrency {concurrency}: short chats a second "
        f"({rounds} x {seconds:g} s a side, interleaved)"
    )
    for name, rate in mean.items():
        line = f"  {name:<16}{rate:>8.0f} req/s"
        if name == "router ingress":
            line += f"   / router local = {rate / mean['router local']:.2f}"
        if failed[name]:
            line += f"   ({failed[name]} failed)"
        print(line)


# The run -------------------------------------------------------------------------------------


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main(args: argparse.Namespace) -> None:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    started = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="capy-ingress-"))
    stand = Stand(root)
    try:
        print(f"starting a standalone role, a server and its joined host in {root} ...", flush=True)
        stand.start()
        for target in stand.targets().values():
            asyncio.run(_first_answer(target))
        print(
            f"the engine simulator as vLLM {benchrole.VLLM_VERSION} (instant), one install, "
            f"a {MODEL_SIZE // GiB} GiB model on each side; {os.cpu_count()} CPUs "
            f"({router._cpu_model()}); the ingress on {INGRESS_ADDRESS}; "
            f"ready in {time.monotonic() - started:.0f} s",
            flush=True,
        )
        latency(stand, args.rounds, args.requests)
        if args.concurrency:
            capacity(stand, args.concurrency, args.seconds, args.rounds)
    except KeyboardInterrupt:
        raise SystemExit("interrupted") from None
    finally:
        # Ctrl-C and SIGTERM wait until everything is stopped.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("stopping the roles and their engines ...", flush=True)
        stand.close()
        tracebacks = stand.tracebacks()
        kept = f"; kept {root} (the roles' state dirs and logs)" if args.keep else ""
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        print(
            f"tracebacks in the roles' logs: {tracebacks}; the run took "
            f"{time.monotonic() - started:.0f} s, the roles' start and stop included{kept}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds over the sides")
    parser.add_argument(
        "--requests", type=int, default=500, help="latency: requests of each kind a side a round"
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="capacity: connections (0: leave it out)"
    )
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="capacity: seconds a side a round"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's folder and logs")
    main(parser.parse_args())
