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
import os
import random
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import benchclient
import benchrole
import router
from benchrole import GiB
from ingressstand import INGRESS_ADDRESS, KINDS, MODEL_SIZE, ROWS, WARM, Stand

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
