"""What the router costs: one simulated engine reached through the router and directly (and
through nginx and LiteLLM's proxy), in one run, each figure beside its baseline as a ratio.

Starts a standalone role on a simulated GPU with two deployments of the engine simulator as
vLLM: `bench`, instant (the whole answer at once, on the simulator's lean path, so the
engine costs well under a millisecond a request and the router is what is measured), and
`bench-paced`, which streams its 2,000-token answer at --pace tokens a second. Every side is
driven by the same lean client (raw asyncio streams, keep-alive connections, warmed up), and
the client's own floor is measured against a canned server. Parts (--parts):

  latency   concurrency 1: p50 and p99 of a short chat, not streamed and streamed (first
            token, last byte), router and direct, and what the router adds (target: 1 ms at
            p50, 3 ms at p99)
  capacity  concurrency 32: short chats a second through the router against direct (target
            50 %), LiteLLM's proxy (target 10x) and nginx (the floor for a loopback proxy)
  relay     tokens a second of the long streamed answer, router against direct, at the
            engine's pace (target 95 %) and unpaced
  streams   N streamed requests held at once through one router: how each ended, the
            router's memory (its parent and workers) and CPU seconds, beside the engine's

    .venv/bin/python bench/router.py [--parts latency,capacity,relay,streams] [--requests N]
        [--seconds S] [--streams N] [--pace TOKENS_PER_S] [--no-litellm] [--no-nginx]

LiteLLM is installed once into bench/.venv-litellm (pip, from PyPI); nginx from Debian
(nginx-light, as root). Either missing is said, with why, and the rest is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis
import yaml

import benchrole
from benchrole import GiB
from capycommon.state.store import InstanceStore
from enginesim.behaviour import Behaviour

BENCH = Path(__file__).resolve().parent
HI = [{"role": "user", "content": "hi"}]
ANSWER = " ".join(["tok"] * 2000)
INSTANT = Behaviour(load_seconds=0.5, instant=True, answer=ANSWER)
# A streamed event that carries generated text (the role chunk's content is empty).
CONTENT = re.compile(rb'"content":\s*"[^"]')
PARTS = ("latency", "capacity", "relay", "streams")
LITELLM_VENV = BENCH / ".venv-litellm"
LITELLM_KEY = "sk-bench"


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def _wait(check: Callable[[], object], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {seconds:.0f} s waiting for {what}")
        time.sleep(0.2)


def _cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == pid:
                    found.append(int(entry.name))
    return found


# The client ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """Where one side's requests go, and as whom."""

    name: str
    port: int
    key: str
    model: str

    def request(self, body: dict[str, Any]) -> bytes:
        data = json.dumps({"model": self.model, **body}).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Authorization: Bearer {self.key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        return head.encode() + data


@dataclass
class Reply:
    status: int
    body: bytes
    first_token_s: float  # to the first generated text (streamed), else to the last byte
    last_byte_s: float


class Connection:
    """One keep-alive HTTP/1.1 connection, read with asyncio's streams: the bench's own lean
    client, the same for every side, so that the client is not what is measured."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def send(self, request: bytes) -> Reply:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        reader = cast(asyncio.StreamReader, self.reader)
        start = time.perf_counter()
        self.writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        headers = {}
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        first: float | None = None
        if b"content-length" in headers:
            body = await reader.readexactly(int(headers[b"content-length"]))
        elif headers.get(b"transfer-encoding") == b"chunked":
            parts: list[bytes] = []
            tail = b""
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                chunk = (await reader.readexactly(size + 2))[:-2]
                parts.append(chunk)
                if first is None:
                    if CONTENT.search(tail + chunk):
                        first = time.perf_counter() - start
                    tail = chunk[-64:]
            await reader.readuntil(b"\r\n")
            body = b"".join(parts)
        else:
            body = await reader.read()
            headers[b"connection"] = b"close"
        done = time.perf_counter() - start
        if headers.get(b"connection") == b"close":
            self.close()
        return Reply(status, body, done if first is None else first, done)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _ended_well(reply: Reply, streamed: bool) -> bool:
    if reply.status != 200:
        return False
    if not streamed:
        return b'"choices"' in reply.body
    return reply.body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in reply.body


# The role ------------------------------------------------------------------------------------


@dataclass
class Engine:
    port: int
    key: str
    model: str
    pid: int
    pgid: int


class Stand:
    """A standalone role on a simulated GPU with the deployments `bench` (instant) and
    `bench-paced` of the simulated vLLM."""

    def __init__(self, root: Path, pace: float, streams: int, workers: str) -> None:
        self.root = root
        self.state = root / "state"
        self.env = benchrole.role_env(root)
        router = {"workers": workers if workers == "auto" else int(workers)}
        document = benchrole.write_document(root, "64GiB", server={"router": router})
        paced = INSTANT.model_copy(update={"instant": False, "tokens_per_second": pace})
        for profile, behaviour in (("vllm", INSTANT), ("vllm-paced", paced)):
            benchrole.install_vllm(root, document.parent, profile, behaviour)
        self.inference = f"127.0.0.1:{benchrole.free_port()}"
        self.log = (root / "role.log").open("wb")
        waiting = str(min(4096, max(256, streams)))
        self.role = benchrole.start_standalone(
            self.state,
            document,
            self.inference,
            self.log,
            self.env,
            extra_flags=[
                # One client (this bench) holds every stream of the streams part.
                "--server-listeners-inference-connections-per-client",
                str(streams + 64),
                "--server-routing-max-pending-per-deployment",
                waiting,
                "--server-routing-max-pending-total",
                waiting,
            ],
            new_session=True,
        )
        _wait(lambda: self.cli("list", "deployments").returncode == 0, 120, "the role")
        for name, profile in (("bench", "vllm"), ("bench-paced", "vllm-paced")):
            benchrole.sparse_model(root / "models" / name, 2 * GiB)
            deployment = root / f"{name}.yaml"
            deployment.write_text(
                f"name: {name}\nengine: {profile}\nmodel: {name}\n"
                "engine_config: {memory: {request: 6GiB}}\n"
            )
            self.cli("deploy", "model", "--file", str(deployment), "--wait", check=True)
        credentials = yaml.safe_load((self.state / "identity" / "credentials").read_text())
        self.api_key = cast(dict[str, str], credentials)["api_key"]
        self.port = int(self.inference.rsplit(":", 1)[1])
        self.engines = [self.engine("bench"), self.engine("bench-paced")]

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
        return benchrole.cli(self.state, self.env, *args, check=check)

    def engine(self, deployment: str) -> Engine:
        async def read() -> Engine:
            path = str(self.state / "redis" / "redis.sock")
            async with aioredis.Redis(unix_socket_path=path) as client:
                store = InstanceStore(client, "local")
                record = await store.get(deployment, 0)
                secret = await store.secret(deployment, 0)
            if record is None or record.port is None or record.process is None or not secret:
                raise SystemExit(f"the deployment {deployment} has no serving engine")
            model = record.served_name or deployment
            process = record.process
            return Engine(record.port, secret, model, process.pid, process.pgid)

        return asyncio.run(read())

    def router_pids(self) -> list[int]:
        """The router's parent and its workers, as `capyctl status --json` names them, and any
        other child of the parent /proc shows."""
        found = self.cli("status", "--json")
        try:
            status = json.loads(found.stdout)
        except ValueError:
            raise SystemExit(f"capyctl status --json: {found.stderr or found.stdout}") from None
        pids: set[int] = set()
        for process in status["processes"]:
            if process["name"] == "router" and process["pid"]:
                pids.add(process["pid"])
                pids.update(w["pid"] for w in process.get("workers", []))
                pids.update(_children(process["pid"]))
        return sorted(pids)

    def close(self) -> None:
        """Stop both engines (a role's stop leaves them running), then the role; an engine
        still there after a minute is killed with its process group."""
        self.cli("drain", "standalone")

        def running() -> list[Engine]:
            return [engine for engine in self.engines if Path(f"/proc/{engine.pid}").exists()]

        with contextlib.suppress(SystemExit):
            _wait(lambda: not running(), 60, "the engines to stop")
        for engine in running():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(engine.pgid, signal.SIGKILL)
        self.role.send_signal(signal.SIGTERM)
        try:
            self.role.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.role.pid, signal.SIGKILL)
            self.role.wait()
        self.log.close()


# The other sides: a canned server, nginx, LiteLLM ---------------------------------------------


CANNED_SERVER = r"""
import asyncio, sys
port, replies = int(sys.argv[1]), sys.argv[2:]
whole, streamed = (open(p, "rb").read() for p in replies)

class Canned(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.data = transport, b""
    def data_received(self, data):
        self.data += data
        while (end := self.data.find(b"\r\n\r\n")) >= 0:
            head = self.data[:end].lower()
            size = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            if len(self.data) < end + 4 + size:
                return
            body, self.data = self.data[end + 4 : end + 4 + size], self.data[end + 4 + size :]
            self.transport.write(streamed if b'"stream": true' in body else whole)

async def main():
    server = await asyncio.get_running_loop().create_server(Canned, "127.0.0.1", port)
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def _canned_replies(folder: Path, whole: Reply, streamed: Reply) -> list[str]:
    """The engine's own answers as a server that does nothing else would send them."""
    body = whole.body
    files = [folder / "whole.http", folder / "streamed.http"]
    files[0].write_bytes(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    chunk = f"{len(streamed.body):x}\r\n".encode() + streamed.body + b"\r\n0\r\n\r\n"
    files[1].write_bytes(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n" + chunk
    )
    return [str(f) for f in files]


NGINX_CONF = """
worker_processes {workers};
daemon off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {folder}/body;
    proxy_temp_path {folder}/proxy;
    fastcgi_temp_path {folder}/fastcgi;
    uwsgi_temp_path {folder}/uwsgi;
    scgi_temp_path {folder}/scgi;
    upstream engine {{
        server 127.0.0.1:{engine};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def _nginx_binary() -> tuple[str | None, str]:
    """nginx, installed from Debian when missing and this runs as root; else why not."""
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )
    if found:
        return found, ""
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return None, "nginx is not installed (as root: apt-get install -y nginx-light)"
    print("installing nginx-light from Debian ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "nginx-light"]
    pid_before = Path("/run/nginx.pid").exists()
    for attempt in ([], ["apt-get", "update", "-qq"]):
        if attempt:
            subprocess.run(attempt, env=env, capture_output=True, timeout=600, check=False)
        done = subprocess.run(
            install, env=env, capture_output=True, text=True, timeout=600, check=False
        )
        if done.returncode == 0:
            break
    else:
        return None, f"apt-get install nginx-light failed: {done.stderr.strip()[-300:]}"
    if not pid_before and Path("/run/nginx.pid").exists():  # the package started its service
        subprocess.run(["/usr/sbin/nginx", "-s", "quit"], capture_output=True, check=False)
    return "/usr/sbin/nginx", ""


def _litellm_binary() -> tuple[str | None, str]:
    """LiteLLM's proxy from its own venv, installed there from PyPI on first use."""
    binary = LITELLM_VENV / "bin" / "litellm"
    if binary.exists():
        return str(binary), ""
    print(f"installing litellm[proxy] into {LITELLM_VENV} (once; minutes) ...", flush=True)
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", str(LITELLM_VENV)], capture_output=True, check=True
        )
        done = subprocess.run(
            [str(LITELLM_VENV / "bin" / "python"), "-m", "pip", "install", "-q", "litellm[proxy]"],
            capture_output=True,
            text=True,
            timeout=1200,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not install LiteLLM into {LITELLM_VENV}: {exc}"
    if done.returncode != 0 or not binary.exists():
        return None, f"pip install 'litellm[proxy]' failed: {done.stderr.strip()[-300:]}"
    return str(binary), ""


@dataclass
class Side:
    """A process the bench started in front of the engine (nginx, LiteLLM, the canned server)."""

    target: Target
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _start(
    argv: list[str], log: Path, port: int, what: str, seconds: float, **env: str
) -> Side | str:
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    deadline = time.monotonic() + seconds
    while not _listening(port):
        if process.poll() is not None or time.monotonic() > deadline:
            side = Side(Target(what, port, "", ""), process)
            side.stop()
            lines = log.read_text(errors="replace").strip().splitlines()[-3:]
            return f"{what} did not start: {' / '.join(lines) or 'no output'}"
        time.sleep(0.2)
    return Side(Target(what, port, "", ""), process)


def start_nginx(folder: Path, engine: Engine) -> Side | str:
    binary, why = _nginx_binary()
    if binary is None:
        return why
    port = benchrole.free_port()
    conf = folder / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(workers=os.cpu_count() or 1, folder=folder, engine=engine.port, port=port)
    )
    started = _start(
        [binary, "-c", str(conf), "-p", str(folder)], folder / "nginx.log", port, "nginx", 20
    )
    if isinstance(started, Side):
        started.target = Target("nginx", port, engine.key, engine.model)
    return started


def start_litellm(folder: Path, engine: Engine) -> Side | str:
    binary, why = _litellm_binary()
    if binary is None:
        return why
    port = benchrole.free_port()
    config = folder / "litellm.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model_list": [
                    {
                        "model_name": "bench",
                        "litellm_params": {
                            "model": f"openai/{engine.model}",
                            "api_base": f"http://127.0.0.1:{engine.port}/v1",
                            "api_key": engine.key,
                        },
                    }
                ],
                "general_settings": {"master_key": LITELLM_KEY},
                "litellm_settings": {"drop_params": True, "telemetry": False},
            }
        )
    )
    argv = [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--num_workers", str(os.cpu_count() or 1)]
    started = _start(
        argv,
        folder / "litellm.log",
        port,
        "LiteLLM",
        180,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_LOG="ERROR",
    )
    if isinstance(started, Side):
        started.target = Target("LiteLLM", port, LITELLM_KEY, "bench")
    return started


# The parts -----------------------------------------------------------------------------------


SHORT = {"messages": HI, "max_tokens": 8}
SHORT_STREAM = {**SHORT, "stream": True}
LONG_STREAM = {"messages": HI, "stream": True}


async def _series(target: Target, body: dict[str, Any], n: int, warm: int = 20) -> list[Reply]:
    """`n` requests one after another on one warm keep-alive connection."""
    connection = Connection(target.port)
    request = target.request(body)
    replies = []
    try:
        for i in range(warm + n):
            reply = await connection.send(request)
            if not _ended_well(reply, bool(body.get("stream"))):
                raise SystemExit(f"{target.name} answered {reply.status}: {reply.body[:300]!r}")
            if i >= warm:
                replies.append(reply)
    finally:
        connection.close()
    return replies


def _row(name: str, base: float, other: float, unit: str = "", target: str = "") -> None:
    ratio = other / base if base else float("nan")
    added = other - base
    print(f"  {name:<34}{base:>9.2f}{other:>9.2f}{added:>9.2f}{ratio:>8.2f}  {target}{unit}")


def latency(stand: Stand, engine: Engine, requests: int, folder: Path) -> None:
    """Concurrency 1, interleaved in blocks so that the machine's other load falls on both
    sides alike."""
    router = Target("router", stand.port, stand.api_key, "bench")
    direct = Target("direct", engine.port, engine.key, engine.model)
    kinds = {"chat": SHORT, "stream": SHORT_STREAM}
    found: dict[tuple[str, str], list[Reply]] = {}
    client_cpu = {"direct": 0.0, "router": 0.0}
    engine_cpu = 0.0
    block, warm = max(10, requests // 10), 5
    blocks = max(1, requests // block)
    for _ in range(blocks):
        for kind, body in kinds.items():
            for side in (direct, router):
                cpu, engine_before = time.process_time(), _cpu_seconds(engine.pid)
                replies = asyncio.run(_series(side, body, block, warm=warm))
                client_cpu[side.name] += time.process_time() - cpu
                if side is direct:
                    engine_cpu += _cpu_seconds(engine.pid) - engine_before
                found.setdefault((side.name, kind), []).extend(replies)
    sent = blocks * len(kinds) * (block + warm)  # by each side, warm-ups included
    # The client's floor: the same requests against a server that only sends the engine's
    # own answers back, from a process of its own.
    canned_port = benchrole.free_port()
    answers = _canned_replies(folder, found["direct", "chat"][0], found["direct", "stream"][0])
    canned = _start(
        [sys.executable, "-c", CANNED_SERVER, str(canned_port), *answers],
        folder / "canned.log",
        canned_port,
        "canned server",
        20,
    )
    floor: dict[str, list[Reply]] = {}
    if isinstance(canned, Side):
        try:
            target = Target("canned", canned_port, "none", engine.model)
            for kind, body in kinds.items():
                floor[kind] = asyncio.run(_series(target, body, requests))
        finally:
            canned.stop()

    def ms(side: str, kind: str, p: float, first: bool = False) -> float:
        replies = found[side, kind]
        return _pct([r.first_token_s if first else r.last_byte_s for r in replies], p) * 1000

    print(f"\nlatency at concurrency 1, ms ({blocks * block} requests a row and side, interleaved)")
    print(f"  {'':<34}{'direct':>9}{'router':>9}{'added':>9}{'ratio':>8}  target (added)")
    rows = [
        ("chat, not streamed", "chat", False),
        ("streamed, first token", "stream", True),
        ("streamed, last byte", "stream", False),
    ]
    for name, kind, first in rows:
        for label, p, goal in (("p50", 0.5, "<= 1 ms"), ("p99", 0.99, "<= 3 ms")):
            base, other = ms("direct", kind, p, first), ms("router", kind, p, first)
            _row(f"{name} {label}", base, other, target=goal)
    for kind, label in (("chat", "chat"), ("stream", "streamed, last byte")):
        if kind in floor:
            values = [r.last_byte_s * 1000 for r in floor[kind]]
            p50, p99 = _pct(values, 0.5), _pct(values, 0.99)
            print(f"  client floor, {label}: p50 {p50:.3f} ms, p99 {p99:.3f} ms (canned server)")
    if not floor:
        print(f"  client floor: {canned}")
    per = {name: cpu / sent * 1e6 for name, cpu in client_cpu.items()}
    print(
        f"  client CPU a request: direct {per['direct']:.0f} us, router {per['router']:.0f} us;"
        f" the engine's own CPU a request: {engine_cpu / sent * 1e6:.0f} us"
    )


async def _load(
    target: Target, body: dict[str, Any], concurrency: int, seconds: float
) -> tuple[int, int]:
    """Requests that ended well, and those that did not, from `concurrency` connections sending
    one after another for `seconds` (after a warm-up of each connection)."""
    request = target.request(body)
    streamed = bool(body.get("stream"))
    connections = [Connection(target.port) for _ in range(concurrency)]
    ok = failed = 0
    said: list[str] = []
    try:
        await asyncio.gather(*(c.send(request) for c in connections))
        deadline = time.perf_counter() + seconds

        async def drive(connection: Connection) -> None:
            nonlocal ok, failed
            while time.perf_counter() < deadline:
                try:
                    reply = await connection.send(request)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    connection.close()
                    failed += 1
                    said.append(repr(exc))
                    continue
                if _ended_well(reply, streamed):
                    ok += 1
                else:
                    failed += 1
                    said.append(f"{reply.status} {reply.body[:200].decode(errors='replace')}")

        await asyncio.gather(*(drive(c) for c in connections))
    finally:
        for connection in connections:
            connection.close()
    if said:
        print(f"  {target.name}: {failed} failed; the first: {said[0]}")
    return ok, failed


def capacity(
    sides: list[Target], concurrency: int, seconds: float, rounds: int, notes: list[str]
) -> None:
    done: dict[str, list[float]] = {side.name: [] for side in sides}
    errors: Counter[str] = Counter()
    for _ in range(rounds):
        for side in sides:
            ok, failed = asyncio.run(_load(side, SHORT, concurrency, seconds))
            done[side.name].append(ok / seconds)
            errors[side.name] += failed
    rate = {name: statistics.mean(values) for name, values in done.items()}
    direct = rate["direct"]
    print(
        f"\ncapacity at concurrency {concurrency}: short chats a second "
        f"({rounds} x {seconds:.0f} s a side, interleaved)"
    )
    print(f"  {'side':<12}{'req/s':>10}{'/ direct':>10}   compared")
    for side in sides:
        name = side.name
        line = f"  {name:<12}{rate[name]:>10.0f}{rate[name] / direct:>10.2f}"
        if name == "router":
            line += "   target >= 0.50 of direct"
        if name == "LiteLLM" and rate[name]:
            line += f"   router / LiteLLM = {rate['router'] / rate[name]:.1f}x (target >= 10x)"
        if name == "nginx":
            share = rate["router"] / rate[name]
            line += f"   the floor for a loopback proxy; router / nginx = {share:.2f}"
        if errors[name]:
            line += f"   ({errors[name]} requests failed)"
        print(line)
    for note in notes:
        print(f"  {note}")


def relay(stand: Stand, paced: Engine, instant: Engine, streams: int, pace: float) -> None:
    print(
        f"\nstreamed relay of a {len(ANSWER.split())}-token answer, tokens a second "
        f"({streams} streams a side, interleaved)"
    )
    print(f"  {'':<34}{'direct':>9}{'router':>9}{'ratio':>8}")
    for name, deployment, engine, goal in (
        (f"paced at {pace:.0f} tokens/s", "bench-paced", paced, "target >= 0.95"),
        ("unpaced (instant engine)", "bench", instant, "the relay's own speed"),
    ):
        rates: dict[str, list[float]] = {"direct": [], "router": []}
        sides = (
            Target("direct", engine.port, engine.key, engine.model),
            Target("router", stand.port, stand.api_key, deployment),
        )
        for _ in range(streams):
            for side in sides:
                (reply,) = asyncio.run(_series(side, LONG_STREAM, 1, warm=1))
                tokens = len(CONTENT.findall(reply.body))
                if tokens != len(ANSWER.split()):
                    raise SystemExit(f"{side.name} streamed {tokens} tokens, not 2000")
                rates[side.name].append(tokens / reply.last_byte_s)
        base, other = statistics.median(rates["direct"]), statistics.median(rates["router"])
        print(f"  {name:<34}{base:>9.0f}{other:>9.0f}{other / base:>8.2f}  {goal}")


@dataclass
class Watch:
    pids: list[int]
    rss_peak: int = 0
    samples: list[int] = field(default_factory=list)

    def rss(self) -> int:
        return sum(_rss_bytes(pid) for pid in self.pids)

    async def run(self) -> None:
        while True:
            now = self.rss()
            self.rss_peak = max(self.rss_peak, now)
            await asyncio.sleep(0.1)


def streams_part(stand: Stand, paced: Engine, n: int, tokens: int) -> None:
    pids = stand.router_pids()
    watch = Watch(pids)
    rest = watch.rss()
    router_cpu = sum(_cpu_seconds(pid) for pid in pids)
    engine_cpu = _cpu_seconds(paced.pid)
    target = Target("router", stand.port, stand.api_key, "bench-paced")
    request = target.request({"messages": HI, "stream": True, "max_tokens": tokens})

    said: dict[str, bytes] = {}  # the first answer of each way to end badly

    async def one() -> str:
        connection = Connection(stand.port)
        try:
            reply = await connection.send(request)
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            return type(exc).__name__
        finally:
            connection.close()
        if _ended_well(reply, True):
            return "200 ended with [DONE]"
        end = str(reply.status) if reply.status != 200 else "200 broken or errored"
        said.setdefault(end, reply.body[-300:])
        return end

    async def run() -> tuple[list[str], float]:
        watching = asyncio.create_task(watch.run())
        start = time.perf_counter()
        try:
            ends = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(n))), 300)
        finally:
            watching.cancel()
        return ends, time.perf_counter() - start

    ends, seconds = asyncio.run(run())
    used = sum(_cpu_seconds(pid) for pid in pids) - router_cpu
    engine_used = _cpu_seconds(paced.pid) - engine_cpu
    after = stand.router_pids()
    shown = ", ".join(f"{end} x {count}" for end, count in sorted(Counter(ends).items()))
    mib = 1 << 20
    print(f"\n{n} streamed requests at once through the router ({tokens} tokens each, paced)")
    print(f"  ended: {shown}, the last after {seconds:.1f} s")
    for end, body in said.items():
        print(f"  the first {end} said: {body.decode(errors='replace').strip()}")
    print(
        f"  router RSS (parent and {len(pids) - 1} workers): {rest / mib:.0f} MiB at rest, "
        f"{watch.rss_peak / mib:.0f} MiB at the peak ({watch.rss_peak / rest:.2f}x)"
    )
    print(
        f"  router CPU: {used:.2f} s ({used / n * 1000:.2f} ms a stream); the engine's CPU "
        f"for the same streams: {engine_used:.2f} s; router / engine = {used / engine_used:.2f}"
    )
    if after != pids:
        print(f"  the router's processes changed during the run: {pids} -> {after}")


def capacity_part(
    stand: Stand, instant: Engine, args: argparse.Namespace, root: Path, sides: list[Side]
) -> None:
    """Direct and the router, and nginx and LiteLLM where they can be had (each started here
    and added to `sides`, which the caller stops)."""
    targets = [
        Target("direct", instant.port, instant.key, instant.model),
        Target("router", stand.port, stand.api_key, "bench"),
    ]
    notes = []
    for name, start in (("nginx", start_nginx), ("LiteLLM", start_litellm)):
        if getattr(args, f"no_{name.lower()}"):
            notes.append(f"{name}: left out (--no-{name.lower()})")
            continue
        folder = root / name.lower()
        folder.mkdir()
        begun = time.monotonic()
        found = start(folder, instant)
        if isinstance(found, str):
            notes.append(f"{name}: not measured: {found}")
            continue
        notes.append(f"{name} took {time.monotonic() - begun:.0f} s to start")
        sides.append(found)
        try:  # a first request, so that a proxy that cannot answer says why
            asyncio.run(_series(found.target, SHORT, 1, warm=2))
        except (SystemExit, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            notes.append(f"{name}: not measured: its first answers failed: {exc}")
            continue
        targets.append(found.target)
    capacity(targets, args.concurrency, args.seconds, args.rounds, notes)


def main(args: argparse.Namespace) -> None:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max(soft, min(hard, args.streams * 2 + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    root = Path(tempfile.mkdtemp(prefix="capy-bench-"))
    started = time.monotonic()
    sides: list[Side] = []
    stand: Stand | None = None
    try:
        print(f"starting a standalone role in {root} ...", flush=True)
        stand = Stand(root, args.pace, args.streams, args.workers)
        instant, paced = stand.engines
        print(
            f"the engine simulator as vLLM 0.29.0 on a simulated GPU; {os.cpu_count()} CPUs "
            f"({_cpu_model()}); router workers: {len(stand.router_pids()) - 1}; "
            f"ready in {time.monotonic() - started:.0f} s"
        )
        runs: dict[str, Callable[[], None]] = {
            "latency": lambda: latency(stand, instant, args.requests, root),
            "capacity": lambda: capacity_part(stand, instant, args, root, sides),
            "relay": lambda: relay(stand, paced, instant, args.relay_streams, args.pace),
            "streams": lambda: streams_part(stand, paced, args.streams, args.stream_tokens),
        }
        for part in (p for p in PARTS if p in parts):
            begun = time.monotonic()
            runs[part]()
            while sides:
                sides.pop().stop()
            print(f"  ({part} took {time.monotonic() - begun:.0f} s)", flush=True)
        print(f"\ntracebacks in the role's logs: {_tracebacks(stand)}")
    finally:
        while sides:
            sides.pop().stop()
        if stand is not None:
            stand.close()
        if args.keep:
            print(f"kept {root} (the role's state dir and logs, the proxies' logs)")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"the whole run took {time.monotonic() - started:.0f} s, the role's start and stop included"
    )


def _tracebacks(stand: Stand) -> int:
    return sum(
        log.read_text(errors="replace").count("Traceback")
        for log in (stand.state / "logs").glob("*.log")
    )


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="which parts, comma-separated")
    parser.add_argument(
        "--requests", type=int, default=400, help="latency: requests a row and side"
    )
    parser.add_argument("--concurrency", type=int, default=32, help="capacity: connections")
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="capacity: seconds a side a round"
    )
    parser.add_argument("--rounds", type=int, default=2, help="capacity: rounds over the sides")
    parser.add_argument(
        "--pace", type=float, default=5000.0, help="relay: the paced engine's tokens/s"
    )
    parser.add_argument("--relay-streams", type=int, default=5, help="relay: streams a side")
    parser.add_argument("--streams", type=int, default=1000, help="streams: requests held at once")
    parser.add_argument("--stream-tokens", type=int, default=32, help="streams: tokens each")
    parser.add_argument("--no-litellm", action="store_true", help="capacity: leave LiteLLM out")
    parser.add_argument("--no-nginx", action="store_true", help="capacity: leave nginx out")
    parser.add_argument(
        "--workers", default="auto", help="the router's workers: N, or auto (the role's default)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's folder and logs")
    main(parser.parse_args())
