"""The router bench's client and the plumbing its parts share: one lean keep-alive HTTP/1.1
client (raw asyncio streams) that drives every side alike, the engine a side reaches, a canned
server that sends an engine's own answers back (the client's floor), and processes started
for a side. bench/router.py and its parts import it from beside them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

HI = [{"role": "user", "content": "hi"}]
# A streamed event that carries generated text (the role chunk's content is empty).
CONTENT = re.compile(rb'"content":\s*"[^"]')
SHORT = {"messages": HI, "max_tokens": 8}
SHORT_STREAM = {**SHORT, "stream": True}
LONG_STREAM = {"messages": HI, "stream": True}


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
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


def ended_well(reply: Reply, streamed: bool) -> bool:
    if reply.status != 200:
        return False
    if not streamed:
        return b'"choices"' in reply.body
    return reply.body.rstrip().endswith(b"data: [DONE]") and b'"error"' not in reply.body


@dataclass
class Engine:
    port: int
    key: str
    model: str
    pid: int
    pgid: int


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


def canned_replies(folder: Path, whole: Reply, streamed: Reply) -> list[str]:
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


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def start_side(
    argv: list[str],
    log: Path,
    port: int,
    what: str,
    seconds: float,
    *,
    key: str = "",
    model: str = "",
    env: Mapping[str, str] | None = None,
) -> Side | str:
    """Start `argv` (its output to `log`, `env` added to ours) and wait up to `seconds` for
    it to listen on `port`: the side, serving `model` behind `key`, or why it did not start."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    deadline = time.monotonic() + seconds
    while not listening(port):
        if process.poll() is not None or time.monotonic() > deadline:
            side = Side(Target(what, port, "", ""), process)
            side.stop()
            lines = log.read_text(errors="replace").strip().splitlines()[-3:]
            return f"{what} did not start: {' / '.join(lines) or 'no output'}"
        time.sleep(0.2)
    return Side(Target(what, port, key, model), process)


async def series(target: Target, body: dict[str, Any], n: int, warm: int = 20) -> list[Reply]:
    """`n` requests one after another on one warm keep-alive connection."""
    connection = Connection(target.port)
    request = target.request(body)
    replies = []
    try:
        for i in range(warm + n):
            reply = await connection.send(request)
            if not ended_well(reply, bool(body.get("stream"))):
                raise SystemExit(f"{target.name} answered {reply.status}: {reply.body[:300]!r}")
            if i >= warm:
                replies.append(reply)
    finally:
        connection.close()
    return replies


def row(name: str, base: float, other: float, unit: str = "", target: str = "") -> None:
    ratio = other / base if base else float("nan")
    added = other - base
    print(f"  {name:<34}{base:>9.2f}{other:>9.2f}{added:>9.2f}{ratio:>8.2f}  {target}{unit}")
