"""The router bench's latency part: at concurrency 1, each role's router against the engine
behind it, in interleaved blocks, and, with several roles (several --capyctl), what each
router adds beside the first's, as a ratio."""

from __future__ import annotations

import asyncio
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import benchrole
from benchclient import (
    CANNED_SERVER,
    SHORT,
    SHORT_STREAM,
    Reply,
    Side,
    Target,
    canned_replies,
    cpu_seconds,
    pct,
    row,
    series,
    start_side,
)


@dataclass(frozen=True)
class Pair:
    """One role's router and the instant engine behind it, named for the tables (no name when
    the run has one role), with the processes that answer each side."""

    name: str
    direct: Target
    router: Target
    servers: dict[str, list[int]]


@dataclass
class Latencies:
    """What the latency part measured: replies by (role, side, kind), and the CPU seconds of
    the client and of the process answering (the engine, or the router's parent and
    workers) by (role, side)."""

    replies: dict[tuple[str, str, str], list[Reply]] = field(default_factory=dict)
    client_cpu: defaultdict[tuple[str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    server_cpu: defaultdict[tuple[str, str], float] = field(
        default_factory=lambda: defaultdict(float)
    )
    sent: int = 0  # by each side, warm-ups included
    timed: int = 0  # a row and side

    def ms(self, key: tuple[str, str, str], p: float, first: bool = False) -> float:
        found = self.replies[key]
        return pct([r.first_token_s if first else r.last_byte_s for r in found], p) * 1000


LATENCY_KINDS = {"chat": SHORT, "stream": SHORT_STREAM}
LATENCY_ROWS = [
    ("chat, not streamed", "chat", False),
    ("streamed, first token", "stream", True),
    ("streamed, last byte", "stream", False),
]


def _interleaved(pairs: list[Pair], requests: int) -> Latencies:
    """Concurrency 1, in blocks that take each kind, role and side in turn, so that the
    machine's other load falls on every side alike."""
    found = Latencies()
    block, warm = max(10, requests // 10), 5
    blocks = max(1, requests // block)
    for _ in range(blocks):
        for kind, body in LATENCY_KINDS.items():
            for pair in pairs:
                for side in (pair.direct, pair.router):
                    key, pids = (pair.name, side.name), pair.servers[side.name]
                    cpu, server = time.process_time(), sum(cpu_seconds(p) for p in pids)
                    replies = asyncio.run(series(side, body, block, warm=warm))
                    found.client_cpu[key] += time.process_time() - cpu
                    found.server_cpu[key] += sum(cpu_seconds(p) for p in pids) - server
                    found.replies.setdefault((*key, kind), []).extend(replies)
    found.sent = blocks * len(LATENCY_KINDS) * (block + warm)
    found.timed = blocks * block
    return found


def _client_floor(found: Latencies, pair: Pair, requests: int, folder: Path) -> None:
    """The same requests against a server that only sends the engine's own answers back,
    from a process of its own: what the client itself costs."""
    canned_port = benchrole.free_port()
    first = {kind: found.replies[pair.name, "direct", kind][0] for kind in LATENCY_KINDS}
    answers = canned_replies(folder, first["chat"], first["stream"])
    canned = start_side(
        [sys.executable, "-c", CANNED_SERVER, str(canned_port), *answers],
        folder / "canned.log",
        canned_port,
        "canned server",
        20,
    )
    if not isinstance(canned, Side):
        print(f"  client floor: {canned}")
        return
    try:
        target = Target("canned", canned_port, "none", pair.direct.model)
        floor = {k: asyncio.run(series(target, b, requests)) for k, b in LATENCY_KINDS.items()}
    finally:
        canned.stop()
    for kind, label in (("chat", "chat"), ("stream", "streamed, last byte")):
        values = [r.last_byte_s * 1000 for r in floor[kind]]
        p50, p99 = pct(values, 0.5), pct(values, 0.99)
        print(f"  client floor, {label}: p50 {p50:.3f} ms, p99 {p99:.3f} ms (canned server)")


def _latency_table(found: Latencies, pair: Pair) -> None:
    name = pair.name
    title = f"role {name}: " if name else ""
    print(f"  {title:<34}{'direct':>9}{'router':>9}{'added':>9}{'ratio':>8}  target (added)")
    for what, kind, first in LATENCY_ROWS:
        for label, p, goal in (("p50", 0.5, "<= 1 ms"), ("p99", 0.99, "<= 3 ms")):
            base = found.ms((name, "direct", kind), p, first)
            other = found.ms((name, "router", kind), p, first)
            row(f"{what} {label}", base, other, target=goal)
    per = {side: found.client_cpu[name, side] / found.sent * 1e6 for side in ("direct", "router")}
    engine, router = (found.server_cpu[name, side] / found.sent * 1e6 for side in per)
    print(
        f"  client CPU a request: direct {per['direct']:.0f} us, router {per['router']:.0f} us;"
        f" the engine's own CPU a request: {engine:.0f} us; the router's: {router:.0f} us"
    )


def _compare(found: Latencies, pairs: list[Pair]) -> None:
    """What each role's router adds at p50, beside the first role's, as a ratio."""
    base = pairs[0].name
    print(f"\n  what the router adds at p50, ms, beside role {base}'s")
    print(f"  {'':<34}" + "".join(f"{'role ' + pair.name:>9}" for pair in pairs) + "   ratio")
    for what, kind, first in LATENCY_ROWS:
        added = [
            found.ms((pair.name, "router", kind), 0.5, first)
            - found.ms((pair.name, "direct", kind), 0.5, first)
            for pair in pairs
        ]
        ratios = ", ".join(f"{a / added[0]:.2f}" if added[0] > 0 else "-" for a in added[1:])
        print(f"  {what:<34}" + "".join(f"{a:>9.2f}" for a in added) + f"   {ratios}")


def latency(pairs: list[Pair], requests: int, folder: Path) -> None:
    """Concurrency 1: each role's router against its own engine, interleaved; with several
    roles (several --capyctl), what each router adds beside the first's."""
    found = _interleaved(pairs, requests)
    print(f"\nlatency at concurrency 1, ms ({found.timed} requests a row and side, interleaved)")
    for pair in pairs:
        _latency_table(found, pair)
    _client_floor(found, pairs[0], requests, folder)
    if len(pairs) > 1:
        _compare(found, pairs)
