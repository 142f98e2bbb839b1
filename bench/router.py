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
        [--capyctl PATH [--capyctl PATH ...]]

--capyctl names the capyctl that starts the role (a release's installed bin/capyctl, this
clone's .venv/bin/capyctl); this clone's by default. Named twice or more, it starts one role
each (A, B, ...): the latency part interleaves all of them, each router against its own
engine, and prints what each router adds beside the first's as a ratio; the other parts run
on each role in turn. Two builds are then compared under the same load, which on a shared
machine moves the figures of runs minutes apart far more than any build does.

LiteLLM is installed once into bench/.venv-litellm (pip, from PyPI); nginx from Debian
(nginx-light, as root). Either missing is said, with why, and the rest is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchrole
from benchclient import (
    CONTENT,
    HI,
    LONG_STREAM,
    SHORT,
    Connection,
    Engine,
    Side,
    Target,
    cpu_seconds,
    ended_well,
    rss_bytes,
    series,
)
from proxies import start_litellm, start_nginx
from routerlatency import Pair, latency
from routerrole import ANSWER, Stand

BENCH = Path(__file__).resolve().parent
PARTS = ("latency", "capacity", "relay", "streams")


# The parts -----------------------------------------------------------------------------------


def pair_of(stand: Stand) -> Pair:
    """The role's router and its instant engine, as the latency part measures them."""
    engine = stand.engines[0]
    return Pair(
        stand.name,
        Target("direct", engine.port, engine.key, engine.model),
        Target("router", stand.port, stand.api_key, "bench"),
        {"direct": [engine.pid], "router": stand.router_pids()},
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
                if ended_well(reply, streamed):
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
                (reply,) = asyncio.run(series(side, LONG_STREAM, 1, warm=1))
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
        return sum(rss_bytes(pid) for pid in self.pids)

    async def run(self) -> None:
        while True:
            now = self.rss()
            self.rss_peak = max(self.rss_peak, now)
            await asyncio.sleep(0.1)


def streams_part(stand: Stand, paced: Engine, n: int, tokens: int) -> None:
    pids = stand.router_pids()
    watch = Watch(pids)
    rest = watch.rss()
    router_cpu = sum(cpu_seconds(pid) for pid in pids)
    engine_cpu = cpu_seconds(paced.pid)
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
        if ended_well(reply, True):
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
    used = sum(cpu_seconds(pid) for pid in pids) - router_cpu
    engine_used = cpu_seconds(paced.pid) - engine_cpu
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
            asyncio.run(series(found.target, SHORT, 1, warm=2))
        except (SystemExit, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            notes.append(f"{name}: not measured: its first answers failed: {exc}")
            continue
        targets.append(found.target)
    capacity(targets, args.concurrency, args.seconds, args.rounds, notes)


def _start_roles(root: Path, args: argparse.Namespace, stands: list[Stand]) -> None:
    """One role for each --capyctl (this clone's when none is named), appended to `stands`
    as each is ready; with several, named A, B, ... in the order given."""
    capyctls = args.capyctl or [None]
    for index, capyctl in enumerate(capyctls):
        name = chr(ord("A") + index) if len(capyctls) > 1 else ""
        folder = root / f"role{name}"
        begun = time.monotonic()
        print(f"starting a standalone role {name}{' ' if name else ''}in {folder} ...", flush=True)
        argv = [capyctl] if capyctl else benchrole.CAPYCTL
        stand = Stand(folder, args.pace, args.streams, args.workers, argv, name)
        stands.append(stand)
        router = stand.router_pids()
        print(
            f"the engine simulator as vLLM 0.29.0 on a simulated GPU; {os.cpu_count()} CPUs "
            f"({_cpu_model()}); router workers: {len(router) - 1}; "
            f"ready in {time.monotonic() - begun:.0f} s"
        )
        print(f"capyctl: {' '.join(argv)}; the router runs {_interpreter(router[0])}")


def _run_part(part: str, stand: Stand, args: argparse.Namespace, sides: list[Side]) -> None:
    """One part other than latency, on one role."""
    instant, paced = stand.engines
    if stand.name:
        print(f"\nrole {stand.name}:")
    if part == "capacity":
        capacity_part(stand, instant, args, stand.root, sides)
    elif part == "relay":
        relay(stand, paced, instant, args.relay_streams, args.pace)
    else:
        streams_part(stand, paced, args.streams, args.stream_tokens)


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
    stands: list[Stand] = []
    try:
        _start_roles(root, args, stands)
        for part in (p for p in PARTS if p in parts):
            begun = time.monotonic()
            if part == "latency":
                latency([pair_of(stand) for stand in stands], args.requests, root)
            for stand in stands if part != "latency" else []:
                _run_part(part, stand, args, sides)
                while sides:
                    sides.pop().stop()
            print(f"  ({part} took {time.monotonic() - begun:.0f} s)", flush=True)
        found = ", ".join(f"{_tracebacks(stand)}" for stand in stands)
        print(f"\ntracebacks in the role's logs: {found}")
    finally:
        while sides:
            sides.pop().stop()
        for stand in stands:
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


def _interpreter(pid: int) -> str:
    """The Python a process runs: its executable and version."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError as exc:
        return f"an unknown Python ({exc})"
    argv = [exe, "-c", "import sys; print(sys.version.split()[0])"]
    found = subprocess.run(argv, capture_output=True, text=True, check=False)
    return f"Python {found.stdout.strip() or '?'} ({exe})"


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
    parser.add_argument(
        "--capyctl",
        action="append",
        help="the capyctl that starts a role and answers its commands (a release's installed "
        "bin/capyctl, this clone's .venv/bin/capyctl); given twice or more, one role each, "
        "measured side by side; this clone's by default",
    )
    parser.add_argument("--keep", action="store_true", help="keep the run's folder and logs")
    main(parser.parse_args())
