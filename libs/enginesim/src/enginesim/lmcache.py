"""A stand-in for LMCache's multi-process server, as `lmcache server` or `python -m
lmcache.v1.multiprocess.http_server` runs it: its flags, its HTTP API, its log lines, and a
cache of chunk keys that the simulated engines fill and hit (`enginesim.kvconnector`).

The real server takes the engines' requests over ZMQ; this one takes them over a plain TCP
line protocol on the same address (`--host`, `--port`). Each line is one JSON object, and
each is answered by one line:

    {"op": "register", "gpu_ids": [0], "engine": "vllm"}  -> {"ok": true}
    {"op": "config"}  -> {"chunk_size": 256, "hash_algorithm": "blake3"}
    {"op": "lookup", "key": "<hex>", "tokens": 256}  -> {"hit": true, "tokens": 256}
    {"op": "store", "key": "<hex>", "tokens": 256}  -> {"ok": true}

A registration lasts while its connection stays open (the engine's heartbeat). Requests wait
until the server is initialised; a malformed one gets {"error": "..."}. Chunks live until
`/api/clear-cache` or the end of the process; past `max_chunks` the least recently used
goes, whatever `--eviction-policy` says.

HTTP (`--http-host`, `--http-port`; no authentication, as the real admin API has none): `/`,
`/api/healthcheck` and `/healthcheck` (503 until initialised), `/api/status` and `/status`,
POST `/api/clear-cache`, `/metrics`; without `api_routes` (the behaviour), as LMCache 0.5.6
serves them, the top-level ones only (`/healthcheck`, `/status`). `/metrics` is also served
on `--prometheus-port` (bound on the HTTP host) unless `--disable-metrics`. A port already
taken is an exit 1 naming it. The behaviour (`LMCacheBehaviour`) sits beside the installed
package and is read at start.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import socket
import sys
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from enginesim import process as proc
from enginesim.behaviour import LMCacheBehaviour, load_lmcache_behaviour
from enginesim.metrics import Exposition
from enginesim.process import Process

log = logging.getLogger("lmcache")
LOG_FORMAT = "[%(asctime)s] LMCache %(levelname)s: %(message)s"
MIB = 1 << 20
PAGE = 4096
EVICTION_POLICIES = ("LRU", "ARC", "IsolatedLRU", "noop")
HASH_ALGORITHMS = ("builtin", "sha256_cbor", "blake3")
UNHEALTHY = {"status": "unhealthy", "reason": "engine not initialized"}
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class ServerArgs:
    host: str
    port: int
    http_host: str
    http_port: int
    prometheus_port: int | None  # None with --disable-metrics
    l1_size_gb: float
    l1_use_lazy: bool
    l1_init_size_gb: float
    eviction_policy: str
    chunk_size: int
    max_workers: int
    hash_algorithm: str


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def build_parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="LMCache multi-process server")
    add = parser.add_argument
    add("--host", default="localhost")
    add("--port", type=int, default=5555)
    add("--http-host", default="127.0.0.1")
    add("--http-port", type=int, default=8080)
    add("--prometheus-port", type=int, default=9090)
    add("--disable-metrics", action="store_true")
    add("--l1-size-gb", type=float, required=True)
    add("--l1-use-lazy", action=argparse.BooleanOptionalAction, default=True)
    add("--l1-init-size-gb", type=float, default=20.0)
    add("--eviction-policy", choices=EVICTION_POLICIES, required=True)
    add("--eviction-trigger-watermark", type=float, default=0.8)
    add("--eviction-ratio", type=float, default=0.2)
    add("--chunk-size", type=_positive, default=256)
    add("--max-workers", "--max-gpu-workers", dest="max_workers", type=_positive, default=1)
    add("--hash-algorithm", choices=HASH_ALGORITHMS, default="blake3")
    add("--worker-reap-timeout-seconds", type=float, default=120.0)
    add("--worker-registration-grace-seconds", type=float, default=3600.0)
    return parser


def parse(argv: Sequence[str], prog: str | None = None) -> ServerArgs:
    ns = build_parser(prog).parse_args(argv)
    metrics = None if ns.disable_metrics else ns.prometheus_port
    return proc.as_parsed(ServerArgs, ns, prometheus_port=metrics)


class Chunks:
    """The cached chunks (key -> tokens it holds), least recently used first."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._tokens: OrderedDict[str, int] = OrderedDict()
        self.stored_tokens = 0
        self.retrieved_tokens = 0

    def __len__(self) -> int:
        return len(self._tokens)

    def store(self, key: str, tokens: int) -> None:
        self._tokens[key] = tokens
        self._tokens.move_to_end(key)
        self.stored_tokens += tokens
        while len(self._tokens) > self.limit:
            self._tokens.popitem(last=False)

    def lookup(self, key: str) -> int | None:
        """The tokens of a cached chunk (counted as retrieved), or None."""
        tokens = self._tokens.get(key)
        if tokens is not None:
            self._tokens.move_to_end(key)
            self.retrieved_tokens += tokens
        return tokens

    def clear(self) -> None:
        self._tokens.clear()


@dataclass
class Session:
    """One engine connection; registered once it said which GPUs it runs on."""

    number: int
    engine: str = ""
    gpu_ids: tuple[int, ...] = ()


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class LMCacheServer:
    def __init__(
        self, args: ServerArgs, version: str, behaviour: LMCacheBehaviour, process: Process
    ) -> None:
        self.args = args
        self.version = version
        self.behaviour = behaviour
        self.process = process
        self.chunks = Chunks(behaviour.max_chunks)
        self.sessions: dict[int, Session] = {}
        self.ready = asyncio.Event()
        self._numbers = itertools.count(1)
        self._writers: set[asyncio.StreamWriter] = set()
        self.resident = bytearray()  # held for the process's RSS

    async def initialise(self) -> None:
        """The engine object exists `startup_seconds` after the HTTP API is up (never, with
        `never_healthy`); the `crash_after_seconds` fault counts from then."""
        if await self.process.pause(self.behaviour.startup_seconds):
            return
        if self.behaviour.never_healthy:
            return
        self.ready.set()
        log.info("LMCache cache server is running...")
        crash = self.behaviour.crash_after_seconds
        if crash is not None:
            self.process.later(
                crash, lambda: self.process.die("RuntimeError: simulated LMCache server crash")
            )

    # The engines' connections (ZMQ in the real server) -------------------------------------

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Session(next(self._numbers))
        self._writers.add(writer)
        try:
            while line := await reader.readline():
                await self.ready.wait()
                answer = await self.answer(session, line)
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError):  # a reset, or a line past the reader's limit
            pass
        finally:
            self._writers.discard(writer)
            self._forget(session)
            writer.close()

    def close_connections(self) -> None:
        for writer in list(self._writers):
            writer.close()

    async def answer(self, session: Session, line: bytes) -> dict[str, Any]:
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            return {"error": "each line must be one JSON object"}
        op = message.get("op")
        if op == "register":
            return self._register(session, message)
        if op == "config":
            return {"chunk_size": self.args.chunk_size, "hash_algorithm": self.args.hash_algorithm}
        if op in ("lookup", "store"):
            return await self._chunk(str(op), message)
        return {"error": f"unknown op {op!r}"}

    def _register(self, session: Session, message: dict[str, Any]) -> dict[str, Any]:
        ids = message.get("gpu_ids")
        if not isinstance(ids, list) or not all(_is_count(i) for i in ids):
            return {"error": "register needs gpu_ids, a list of integers"}
        session.engine = str(message.get("engine") or "unknown")
        session.gpu_ids = tuple(ids)
        self.sessions[session.number] = session
        log.info(
            "Registered a %s worker (session %d) on GPU ids %s",
            session.engine,
            session.number,
            list(session.gpu_ids),
        )
        return {"ok": True}

    def _forget(self, session: Session) -> None:
        if self.sessions.pop(session.number, None) is not None:
            log.info(
                "Unregistered the %s worker (session %d) on GPU ids %s: its connection closed",
                session.engine,
                session.number,
                list(session.gpu_ids),
            )

    async def _chunk(self, op: str, message: dict[str, Any]) -> dict[str, Any]:
        key, tokens = message.get("key"), message.get("tokens")
        if not (isinstance(key, str) and key and isinstance(tokens, int) and _is_count(tokens)):
            return {"error": f"{op} needs a key and a number of tokens"}
        if op == "store":
            await asyncio.sleep(self.behaviour.store_seconds)
            self.chunks.store(key, tokens)
            log.info("Stored %d tokens", tokens)
            return {"ok": True}
        found = self.chunks.lookup(key)
        if found is None:
            return {"hit": False, "tokens": 0}
        log.info("Retrieved %d tokens", found)
        return {"hit": True, "tokens": found}

    # HTTP ----------------------------------------------------------------------------------

    def registered_gpu_ids(self) -> list[int]:
        return sorted({gpu for session in self.sessions.values() for gpu in session.gpu_ids})

    async def root(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "service": "LMCache HTTP API"})

    async def health(self, request: Request) -> Response:
        if not self.ready.is_set():
            return JSONResponse(UNHEALTHY, status_code=503)
        return JSONResponse({"status": "healthy"})

    async def status(self, request: Request) -> Response:
        if not self.ready.is_set():
            return JSONResponse(UNHEALTHY, status_code=503)
        storage = {
            "l1_size_gb": self.args.l1_size_gb,
            "eviction_policy": self.args.eviction_policy,
            "stored_chunks": len(self.chunks),
        }
        return JSONResponse(
            {
                "chunk_size": self.args.chunk_size,
                "hash_algorithm": self.args.hash_algorithm,
                "registered_gpu_ids": self.registered_gpu_ids(),
                "active_sessions": len(self.sessions),
                "storage_manager": storage,
                "gpu_context_meta": {},
            }
        )

    async def clear_cache(self, request: Request) -> Response:
        if not self.ready.is_set():
            return JSONResponse(UNHEALTHY, status_code=503)
        self.chunks.clear()
        log.info("Cleared the cache")
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.exposition(), media_type=METRICS_TYPE)

    def exposition(self) -> str:
        out = Exposition()
        out.counter("lmcache_mp_stored_tokens", "Tokens stored.", [({}, self.chunks.stored_tokens)])
        out.counter(
            "lmcache_mp_retrieved_tokens",
            "Tokens retrieved.",
            [({}, self.chunks.retrieved_tokens)],
        )
        out.gauge("lmcache_mp_stored_chunks", "Chunks held.", [({}, len(self.chunks))])
        out.gauge("lmcache_mp_active_sessions", "Registered workers.", [({}, len(self.sessions))])
        return out.text()

    async def metrics_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """The Prometheus port: one plain HTTP answer, `/metrics` or 404, then it closes."""
        try:
            request = (await reader.readline()).decode("latin-1").split()
            while (await reader.readline()).strip():
                pass  # the headers
            found = request[:2] in (["GET", "/metrics"], ["HEAD", "/metrics"])
            status, body = (
                ("200 OK", self.exposition().encode()) if found else ("404 Not Found", b"")
            )
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {METRICS_TYPE}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (ConnectionError, ValueError):
            pass
        finally:
            writer.close()


def build_app(server: LMCacheServer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.process.spawn(server.initialise())
        yield

    app = FastAPI(title="LMCache HTTP API", lifespan=lifespan)
    add = app.add_api_route
    add("/", server.root, methods=["GET"])
    add("/healthcheck", server.health, methods=["GET"])
    add("/status", server.status, methods=["GET"])
    if server.behaviour.api_routes:
        add("/api/healthcheck", server.health, methods=["GET"])
        add("/api/status", server.status, methods=["GET"])
        add("/api/clear-cache", server.clear_cache, methods=["POST"])
    add("/metrics", server.metrics, methods=["GET"])
    return app


def _bind(process: Process, what: str, host: str, port: int) -> socket.socket:
    try:
        return proc.open_socket(host, port, reuse_port=False)
    except OSError as exc:
        process.die(f"LMCache ERROR: cannot bind the {what} port {host}:{port}: {exc.strerror}")


def _resident(mib: int) -> bytearray:
    """`mib` MiB written page by page, so that they count in the process's RSS."""
    buffer = bytearray(mib * MIB)
    buffer[::PAGE] = b"\x01" * len(range(0, len(buffer), PAGE))
    return buffer


async def _serve(
    process: Process, args: ServerArgs, version: str, behaviour: LMCacheBehaviour
) -> int:
    log.info("LMCache %s multi-process server: %s", version, args)
    if "PYTHONHASHSEED" not in os.environ:
        log.warning(
            "PYTHONHASHSEED is not set: chunk hashes differ from one process to the next, so "
            "a restarted engine misses what it stored before"
        )
    if behaviour.fail_at_start:
        process.die(behaviour.fail_message)
    zmq = _bind(process, "ZMQ", args.host, args.port)
    process.at_exit(zmq.close)
    http = _bind(process, "HTTP", args.http_host, args.http_port)
    process.at_exit(http.close)
    metrics = None
    if args.prometheus_port is not None:
        metrics = _bind(process, "Prometheus", args.http_host, args.prometheus_port)
        process.at_exit(metrics.close)
    server = LMCacheServer(args, version, behaviour, process)
    server.resident = _resident(behaviour.resident_mib)
    listeners = [await asyncio.start_server(server.connection, sock=zmq)]
    log.info("Engines connect to tcp://%s:%d", args.host, args.port)
    if metrics is not None:
        listeners.append(await asyncio.start_server(server.metrics_connection, sock=metrics))
    try:
        await proc.serve(build_app(server), http, process, _nothing)
    finally:
        for listener in listeners:
            listener.close()
        server.close_connections()
    log.info("LMCache server stopped")
    return 0


async def _nothing() -> None:
    return None


def run(argv: Sequence[str], version: str, behaviour_file: Path | None, prog: str | None) -> int:
    """Run the server at `version` with `argv`; what the installed `lmcache` shims call."""
    args = parse(argv, prog)
    behaviour = load_lmcache_behaviour(behaviour_file)
    proc.configure_logging(LOG_FORMAT, sys.stdout, "%Y-%m-%d %H:%M:%S")
    return proc.run(lambda process: _serve(process, args, version, behaviour))


def cli(argv: Sequence[str], version: str, behaviour_file: Path | None) -> int:
    """The `lmcache` console script: `lmcache server [flags]`."""
    top = argparse.ArgumentParser(prog="lmcache")
    top.add_argument("command", choices=["server"])
    top.parse_args(argv[:1])
    return run(argv[1:], version, behaviour_file, "lmcache server")
