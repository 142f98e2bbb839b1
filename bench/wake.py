"""What CapyCTL adds to a wake, a switch and a cold start, against the engine's own calls.

Starts a standalone role on a simulated 24 GiB GPU with the engine simulator as vLLM and two
host_backed deployments, `a` and `b`, that do not both fit ready (each 14 GiB). Each figure is
printed beside its baseline, measured on the same engine in the same run:

- wake: a request for a parked `a` to its first token (through the router), against the
  engine's own wake calls (those hostd makes: /wake_up weights, /wake_up kv_cache,
  /reset_prefix_cache, timed here directly) plus a one-token chat's first token;
- switch: a request for the parked one of `a` and `b` while the other is ready, to its first
  token, against the engine's own park call (/sleep) plus its wake calls and first token;
- span: the same switch between `big`, a model across two simulated GPUs (a rank on each,
  both parked and woken by its one /sleep and /wake_up calls), and `a` on one of them, on a
  stand of its own;
- cold start: from the engine's own readiness (its /health first answering 200, polled here
  every few milliseconds) to hostd recording it ready, and to the request's first token.

Each round also shows where the time went, in milliseconds after the request was sent: from
Redis (the demand, the scheduler's choices and commands, hostd's transitions) and hostd's
log (when it took a command up, its engine calls and canary).

    .venv/bin/python bench/wake.py [--rounds N] [--only wake switch cold span]
        [--late-release-ms MS]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import httpx

from capycommon.state import keys
from enginesim.behaviour import Behaviour
from wakestand import (
    BEHAVIOUR,
    HEALTH_POLL_S,
    HOST,
    LATE_RELEASE_MS,
    ONE_TOKEN,
    SPAN,
    Engine,
    Stand,
    engine_park_wake,
    engine_wake,
    first_token,
    through_router,
    until,
)


@dataclass
class Timeline:
    """Moments (wall clock) of one request's way, from Redis and hostd's log."""

    sent: float
    marks: list[tuple[str, float]] = field(default_factory=list)

    def add(self, what: str, at: float | None) -> None:
        if at is not None:
            self.marks.append((what, at))

    def at(self, what: str) -> float | None:
        """The first moment marked `what` (None when hostd's log does not say it)."""
        return min((at for name, at in self.marks if name == what), default=None)

    def gap(self, start: str | float, end: str | float, less: float = 0.0) -> float | None:
        """Seconds from `start` to `end` (marks or moments), less `less`."""
        a = self.at(start) if isinstance(start, str) else start
        b = self.at(end) if isinstance(end, str) else end
        return None if a is None or b is None else b - a - less

    def show(self, end: float) -> str:
        marks = sorted([*self.marks, ("first token", self.sent + end)], key=lambda m: m[1])
        return "  ".join(f"{what} +{(at - self.sent) * 1000:.0f}" for what, at in marks)


def _entries(stand: Stand, stream: str, since: float) -> list[tuple[float, dict[str, Any]]]:
    """The JSON entries of a stream since `since`, each with the moment Redis added it."""
    found = cast(
        list[tuple[bytes, dict[bytes, bytes]]],
        stand.redis.xrange(stream, min=f"{int(since * 1000)}-0"),
    )
    out = []
    for entry_id, fields in found:
        millis = int(entry_id.decode().split("-")[0])
        try:
            out.append((millis / 1000, json.loads(next(iter(fields.values())))))
        except ValueError:
            continue
    return out


def timeline(stand: Stand, sent: float, names: tuple[str, ...]) -> Timeline:
    """The demand, choices, commands and hostd's transitions and engine calls since `sent`."""
    line = Timeline(sent)
    demands = [
        at for at, d in _entries(stand, keys.demands(), sent - 0.01) if d.get("deployment") in names
    ]
    line.add("demand", min((d for d in demands if d >= sent - 0.005), default=None))
    for _, choice in _entries(stand, keys.events(), sent - 0.01):
        if choice.get("deployment") in names and choice.get("at", 0) >= sent:
            line.add(f"decide {choice['kind']} {choice['deployment']}", choice["at"])
    for _, event in _entries(stand, keys.host_events(HOST), sent - 0.01):
        mine = event.get("deployment") in names and event.get("at", 0) >= sent
        if mine and event.get("kind") == "transition" and event["from_state"] != event["to_state"]:
            line.add(f"{event['deployment']} {event['to_state']}", event["at"])
    for record in hostd_phases(stand, sent):
        for what, at in record.items():
            line.add(what, at)
    return line


def hostd_phases(stand: Stand, since: float) -> list[dict[str, float]]:
    """The steps of the starts, parks and wakes hostd's log tells since `since` (its
    `steps`)."""
    found = []
    log = stand.state / "logs" / "hostd.log"
    for raw in log.read_text(errors="replace").splitlines():
        if '"steps"' not in raw:
            continue
        try:
            fields = json.loads(raw)["fields"]
        except (ValueError, KeyError):
            continue
        steps = fields.get("steps") or {}
        member = str(fields.get("member", "")).split(":")[0]
        if all(isinstance(v, int | float) and v >= since for v in steps.values()):
            found.append({f"{member} {k}": float(v) for k, v in steps.items()})
    return found


# The measurements ----------------------------------------------------------------------------


@dataclass
class Figures:
    title: str
    baseline: str
    rows: list[tuple[float, float]] = field(default_factory=list)  # (ours, engine's), s
    # Where the added time went, per round: each part in seconds.
    parts: dict[str, list[float]] = field(default_factory=dict)
    # Per round, the part of the added time the engine's device spent showing its park's
    # release late, which a park must wait for (the engine's own, timed directly).
    late_release: list[float] = field(default_factory=list)
    # The most CapyCTL may add at the median, in milliseconds (None: no target).
    target_ms: float | None = None

    def part(self, name: str, seconds: float | None) -> None:
        if seconds is not None:
            self.parts.setdefault(name, []).append(seconds)

    def print(self) -> None:
        ours = [a for a, _ in self.rows]
        base = [b for _, b in self.rows]
        added = [a - b for a, b in self.rows]
        print(f"\n{self.title} ({len(self.rows)} rounds; milliseconds)")
        print(f"{'':<8}{'capyctl':>10}{self.baseline:>26}{'added':>8}{'ratio':>8}")
        for label, pick in (("median", statistics.median), ("max", max)):
            a, b, d = pick(ours) * 1000, pick(base) * 1000, pick(added) * 1000
            ratio = pick(ours) / pick(base) if pick(base) else float("nan")
            print(f"{label:<8}{a:>10.0f}{b:>26.0f}{d:>8.0f}{ratio:>8.2f}")
        if self.target_ms is not None:
            met = statistics.median(added) * 1000 <= self.target_ms
            print(f"  target: at most {self.target_ms:g} added: {'met' if met else 'NOT met'}")
        if self.late_release:
            beyond = [d - late for d, late in zip(added, self.late_release, strict=True)]
            print(
                "  added beyond the device's late release (the engine's own): median "
                f"{statistics.median(beyond) * 1000:.0f}, max {max(beyond) * 1000:.0f}"
            )
            if self.target_ms is not None:
                met = statistics.median(beyond) * 1000 <= self.target_ms
                print(
                    f"  target against the engine's park, release, wake and token: "
                    f"{'met' if met else 'NOT met'}"
                )
        if self.parts:
            print(f"  where it went{'median':>60}{'max':>8}")
        for name, values in self.parts.items():
            median, most = statistics.median(values) * 1000, max(values) * 1000
            print(f"  {name:<64}{median:>8.0f}{most:>8.0f}")


def wakes(stand: Stand, rounds: int) -> Figures:
    """A request for the parked `a`, against its engine's own wake and first token."""
    figures = Figures(
        "wake: request for a parked model -> first token", "engine wake+token", target_ms=50
    )
    stand.cli("start", "deployment", "a", "--wait", check=True)
    steady(stand, "a", 20)
    for i in range(rounds):
        # The request of the round before woke it, and it stays ready: park it again.
        if _steady(stand, "a") == "ready":
            stand.cli("park", "deployment", "a", "--wait", check=True)
        own = engine_wake(stand, "a")
        time.sleep(0.3)  # the role at rest, as a request would find it
        sent, ours = through_router(stand, "a")
        base = own.wake_s + own.token_s
        figures.rows.append((ours, base))
        print(
            f"wake {i + 1}: {ours * 1000:.0f} ms (engine: wake {own.wake_s * 1000:.0f} + "
            f"token {own.token_s * 1000:.0f} = {base * 1000:.0f}; added "
            f"{(ours - base) * 1000:+.0f})"
        )
        time.sleep(0.3)
        line = timeline(stand, sent, ("a",))
        print("   ", line.show(ours))
        end = sent + ours
        figures.part(
            "request -> hostd has the wake (router, scheduler)", line.gap(sent, "a received")
        )
        figures.part(
            "hostd has it -> engine awake, less the engine's wake calls",
            line.gap("a received", "a woke", less=own.wake_s),
        )
        figures.part("engine awake -> ready record (the canary)", line.gap("a woke", "a ready"))
        figures.part("ready record -> first token (router, engine)", line.gap("a ready", end))
    return figures


def steady(stand: Stand, name: str, rounds: int) -> None:
    """What the router adds to a one-token request for a ready model: the part of a wake's
    added time that is not the wake's."""
    with stand.engine(name) as http:
        direct = [first_token(http, "/v1/chat/completions", {"model": name, **ONE_TOKEN})]
        routed = [through_router(stand, name)[1]]
        for _ in range(rounds):
            direct.append(first_token(http, "/v1/chat/completions", {"model": name, **ONE_TOKEN}))
            routed.append(through_router(stand, name)[1])
    a, b = statistics.median(routed[1:]), statistics.median(direct[1:])
    print(
        f"a ready model, one token ({rounds} each, median): through the router "
        f"{a * 1000:.0f} ms, directly {b * 1000:.0f} ms (the router adds {(a - b) * 1000:.0f})"
    )


def switches(stand: Stand, rounds: int, title: str = "switch: park one, wake the other") -> Figures:
    """A request for the parked one of the stand's two deployments while the other is ready,
    against the ready engine's own park plus wake and first token."""
    figures = Figures(f"{title} -> first token", "engine park+wake+token", target_ms=100)
    first, second = stand.names
    stand.cli("start", "deployment", first, "--wait", check=True)
    through_router(stand, second)  # it starts; the first is parked for it
    until(lambda: stand.state_of(first) == "parked", f"{first} to park")
    ready, parked = second, first
    for i in range(rounds):
        time.sleep(0.3)
        own = engine_park_wake(stand, ready)
        time.sleep(0.3)
        sent, ours = through_router(stand, parked)
        base = own.park_s + own.wake_s + own.token_s
        figures.rows.append((ours, base))
        figures.late_release.append(own.release_s)
        print(
            f"switch {i + 1} ({ready} -> {parked}): {ours * 1000:.0f} ms (engine: park "
            f"{own.park_s * 1000:.0f} + wake {own.wake_s * 1000:.0f} + token "
            f"{own.token_s * 1000:.0f} = {base * 1000:.0f}; added {(ours - base) * 1000:+.0f}; "
            f"its memory showed released {own.release_s * 1000:.0f} after its park call)"
        )
        until(partial(_is_parked, stand, ready), f"{ready} to park")
        line = timeline(stand, sent, stand.names)
        print("   ", line.show(ours))
        _switch_parts(figures, line, own, (ready, parked), (sent, sent + ours))
        ready, parked = parked, ready
    return figures


def _switch_parts(
    figures: Figures,
    line: Timeline,
    own: Engine,
    members: tuple[str, str],
    span: tuple[float, float],
) -> None:
    """Where one switch's time went, from the ready one (`x`) parking to the parked one (`y`)
    answering, each part less the engine's own calls within it."""
    x, y = members
    sent, end = span
    figures.part(
        "request -> the ready one parking (drain, idle reading, choice)",
        line.gap(sent, f"{x} parking"),
    )
    figures.part(
        "  request -> drain decided (router, scheduler)", line.gap(sent, f"decide drain {x}")
    )
    figures.part(
        "  drain decided -> park decided (hostd's idle reading, scheduler)",
        line.gap(f"decide drain {x}", f"decide park {x}"),
    )
    figures.part("  park decided -> parking (hostd)", line.gap(f"decide park {x}", f"{x} parking"))
    figures.part(
        "parking -> parked, less the engine's park call (memwatch)",
        line.gap(f"{x} parking", f"{x} parked", less=own.park_s),
    )
    figures.part(
        "  park call returned -> memwatch shows it released",
        line.gap(f"{x} slept", f"{x} released"),
    )
    figures.part(
        "    of which the device's late release (the engine's own)",
        own.release_s,
    )
    figures.part("  released -> parked record", line.gap(f"{x} released", f"{x} parked"))
    figures.part(
        "parked -> hostd has the wake (scheduler)", line.gap(f"{x} parked", f"{y} received")
    )
    figures.part(
        "hostd has it -> engine awake, less the engine's wake calls",
        line.gap(f"{y} received", f"{y} woke", less=own.wake_s),
    )
    figures.part("engine awake -> ready record (the canary)", line.gap(f"{y} woke", f"{y} ready"))
    figures.part("ready record -> first token (router, engine)", line.gap(f"{y} ready", end))


def cold_starts(stand: Stand, rounds: int) -> Figures:
    """A request for a stopped `a`: from the engine's own readiness (/health 200) to hostd's
    ready record, and on to the request's first token."""
    figures = Figures(
        "cold start: engine ready (/health 200) -> hostd ready", "engine start->health"
    )
    for i in range(rounds):
        stand.cli("drain", "standalone", check=True)
        until(
            lambda: all(stand.state_of(n) in (None, "stopped") for n in ("a", "b")),
            "the engines to stop",
        )
        time.sleep(0.3)
        with ThreadPoolExecutor(1) as pool:
            request = pool.submit(through_router, stand, "a")
            record = until(lambda: _starting(stand), "the launch", timeout=60)
            launched = float(record["since"])
            healthy = _health(stand, "a", deadline=time.monotonic() + 120)
            sent, first = request.result()
        ready = until(partial(_ready_at, stand, sent), "hostd's ready record", timeout=5)
        figures.rows.append((ready - launched, healthy - launched))
        print(
            f"cold start {i + 1}: engine /health 200 at +{(healthy - sent) * 1000:.0f} ms, "
            f"hostd ready at +{(ready - sent) * 1000:.0f} ms (added "
            f"{(ready - healthy) * 1000:+.0f}), first token at +{first * 1000:.0f} ms"
        )
        line = timeline(stand, sent, ("a",))
        line.add("engine /health 200", healthy)
        print("   ", line.show(first))
        figures.part(
            "engine /health 200 -> hostd sees it (its probe)", line.gap(healthy, "a healthy")
        )
        figures.part(
            "hostd sees it -> ready record (canary, port check)", line.gap("a healthy", "a ready")
        )
        figures.part("ready record -> first token (router, engine)", line.gap(ready, sent + first))
    return figures


def _steady(stand: Stand, name: str, hold_s: float = 1.5) -> str:
    """The deployment's state once it stayed ready or parked for `hold_s`."""
    deadline = time.monotonic() + 60
    seen, since = stand.state_of(name), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = stand.state_of(name)
        if now != seen:
            seen, since = now, time.monotonic()
        elif seen in ("ready", "parked") and time.monotonic() - since >= hold_s:
            return seen
    raise SystemExit(f"{name} did not settle (it is {seen})")


def _is_parked(stand: Stand, name: str) -> bool:
    return stand.state_of(name) == "parked"


def _starting(stand: Stand) -> dict[str, Any] | None:
    record = stand.record("a")
    if record is None or record["state"] != "starting" or not record.get("port"):
        return None
    if stand.redis.get(keys.instance_secret(HOST, "a", 0)) is not None:  # written before spawn
        return record
    return None


def _health(stand: Stand, name: str, deadline: float) -> float:
    """The wall-clock moment the engine's /health first answered 200 (polled every 2 ms)."""
    with stand.engine(name) as http:
        while time.monotonic() < deadline:
            try:
                if http.get("/health", timeout=1).status_code == 200:
                    return time.time()
            except httpx.TransportError:
                pass
            time.sleep(HEALTH_POLL_S)
    raise SystemExit("the engine never answered /health")


def _ready_at(stand: Stand, since: float) -> float | None:
    for _, event in _entries(stand, keys.host_events(HOST), since):
        if event.get("deployment") == "a" and event.get("to_state") == "ready":
            return float(event["at"])
        if event.get("deployment") == "a" and event.get("to_state") == "failed":
            raise SystemExit(f"the launch failed: {event.get('reason')}")
    return None


def spans(behaviour: Behaviour, rounds: int) -> Figures:
    """The switch between a model across two GPUs and a model on one of them, on a stand of
    its own with two simulated GPUs, against the engines' own park and wake calls."""
    root = Path(tempfile.mkdtemp(prefix="capy-span-"))
    stand = Stand(root, behaviour, gpus="gpu0:24GiB,gpu1:24GiB", documents=SPAN)
    try:
        return switches(stand, rounds, "switch between a 2-GPU model and a 1-GPU model")
    finally:
        stand.close()
        shutil.rmtree(root, ignore_errors=True)


def main(rounds: int, phases: list[str], late_release_ms: float) -> None:
    root = Path(tempfile.mkdtemp(prefix="capy-wake-"))
    behaviour = BEHAVIOUR.model_copy(update={"memory_lag_seconds": late_release_ms / 1000})
    stand = Stand(root, behaviour) if set(phases) - {"span"} else None
    try:
        runs = {"wake": wakes, "switch": switches, "cold": cold_starts}
        results = []
        for name in phases:
            if name == "span":
                results.append(spans(behaviour, rounds))
            elif stand is not None:
                results.append(runs[name](stand, rounds))
        for figures in results:
            figures.print()
        print(
            f"\nthe simulator as vLLM: wake_up {behaviour.wake_seconds:g} s per tag (two tags), "
            f"sleep {behaviour.sleep_seconds:g} s, load {behaviour.load_seconds:g} s; its device "
            f"shows a park's release {late_release_ms:g} ms after the call returned; "
            "each request streamed, max_tokens 1"
        )
    finally:
        if stand is not None:
            stand.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("wake", "switch", "cold", "span"),
        default=["wake", "switch", "cold", "span"],
    )
    parser.add_argument(
        "--late-release-ms",
        type=float,
        default=LATE_RELEASE_MS,
        help="how late the simulated device shows a park's memory released after the call",
    )
    args = parser.parse_args()
    main(args.rounds, args.only, args.late_release_ms)
