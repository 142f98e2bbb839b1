"""The router's Prometheus metrics: requests per deployment by outcome, running and waiting,
queue wait, the wait for a model to become ready, time to first token, cancellations,
queue_full; what the hosts' event streams report: start, wake and park durations, the
engine's own part of each and CapyCTL's, and the bytes and durations of model downloads
from the Hub; what the scheduler's choice stream reports: switch durations (the engines'
part apart) and evictions by cause; and, read at each scrape, what the scheduler's ledger
charges on each GPU by phase, with each GPU's capacity and limits.

The router's workers write theirs into one folder (Prometheus's multiprocess mode, on when
`PROMETHEUS_MULTIPROC_DIR` names it, `capyctl_router.workers`): /metrics sums the counts of
every worker, and the gauges of the live ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from pydantic import ValidationError

from capycommon.domain.desired import Choice
from capycommon.domain.instances import Event
from capycommon.domain.memory import ChargePhase, GpuMemory
from capycommon.paths import write_atomic
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state.stores import State

# In the workers' metrics folder: how far the hosts' events were read.
CURSORS_FILE = "events-read.json"
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
DOWNLOAD_SECONDS = (1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 14400)
# hostd's transition into a state, and the operation whose end it marks.
OPERATIONS = {
    ("starting", "ready"): "start",
    ("waking", "ready"): "wake",
    ("parking", "parked"): "park",
}


def start_cursors(folder: Path) -> None:
    """Mark the router's start in a new metrics folder: its events are read from here."""
    write_atomic(folder / CURSORS_FILE, json.dumps({"start": _now_id(), "hosts": {}}))


@dataclass
class Cursors:
    """How far the hosts' events and the scheduler's choices were read, kept in the
    workers' metrics `folder` (when there is one) after each read."""

    start: str
    folder: Path | None = None
    hosts: dict[str, str] = field(default_factory=dict)
    choices: str | None = None

    @classmethod
    def read(cls, folder: Path | None) -> Cursors:
        """The kept cursors; where a stream not read before starts (the router's start, else
        now)."""
        if folder is not None:
            try:
                kept = json.loads((folder / CURSORS_FILE).read_text())
                hosts = {str(h): str(c) for h, c in kept["hosts"].items()}
                choices = kept.get("choices")
                found = None if choices is None else str(choices)
                return cls(str(kept["start"]), folder, hosts, found)
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass
        return cls(_now_id(), folder)

    def keep(self) -> None:
        if self.folder is not None:
            kept = {"start": self.start, "hosts": self.hosts, "choices": self.choices}
            write_atomic(self.folder / CURSORS_FILE, json.dumps(kept))


def _now_id() -> str:
    return f"{int(time.time() * 1000)}-0"


def _seconds(registry: CollectorRegistry, name: str, documentation: str, *labels: str) -> Histogram:
    """A duration per deployment (and `labels`), in the buckets every one shares."""
    return Histogram(
        name, documentation, ["deployment", *labels], buckets=SECONDS, registry=registry
    )


class LifecycleSeconds:
    """Start, wake, park and switch durations, each with its engines' part apart from
    CapyCTL's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.total = _seconds(
            registry,
            "capyctl_lifecycle_seconds",
            "Start, wake and park durations, from the hosts' events; switch durations, from "
            "the scheduler's choice to release the first victim to the model ready.",
            "operation",
        )
        self.engine = _seconds(
            registry,
            "capyctl_lifecycle_engine_seconds",
            "The engine's own part of each start, wake and park: its load (from its spawn to "
            "its health), its wake calls, its sleep call; of a switch: the victims' sleep "
            "calls and stops, and the model's load or wake calls.",
            "operation",
        )
        self.overhead = _seconds(
            registry,
            "capyctl_lifecycle_overhead_seconds",
            "CapyCTL's part of each start, wake, park and switch: all but the engines' own "
            "part (waiting for the GPU, readiness checks, the canary, memory verification, "
            "drains).",
            "operation",
        )

    def observe(
        self, deployment: str, operation: str, seconds: float, engine_s: float | None
    ) -> None:
        """One start, wake, park or switch, and its engines' part apart from CapyCTL's."""
        self.total.labels(deployment, operation).observe(seconds)
        if engine_s is not None:
            engine = min(engine_s, seconds)
            self.engine.labels(deployment, operation).observe(engine)
            self.overhead.labels(deployment, operation).observe(seconds - engine)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        by_route = "Requests by outcome and route (chat.completions, responses, messages, ...)."
        self.requests = Counter(
            "capyctl_requests", by_route, ["deployment", "outcome", "route"], registry=r
        )
        self.running = Gauge(
            "capyctl_requests_running",
            "Requests holding a place.",
            ["deployment"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.waiting = Gauge(
            "capyctl_requests_waiting",
            "Requests waiting in the queue.",
            ["deployment"],
            registry=r,
            multiprocess_mode="livesum",
        )

        self.queue_wait_s = _seconds(r, "capyctl_queue_wait_seconds", "Time until a place.")
        self.ttft_s = _seconds(
            r, "capyctl_time_to_first_token_seconds", "From arrival to the engine's first output."
        )
        self.cancellations = Counter(
            "capyctl_cancellations", "Requests cut short.", ["deployment"], registry=r
        )
        self.queue_fulls = Counter(
            "capyctl_queue_full", "Requests refused: queue full.", ["deployment"], registry=r
        )
        self.lifecycle = LifecycleSeconds(r)
        self.evictions = Counter(
            "capyctl_evictions",
            "Engines the scheduler parked or stopped while they served or were parked, by "
            "why: switch, idle, operator, drain, revision, restart, max_parked.",
            ["deployment", "reason"],
            registry=r,
        )
        self.ready_wait_s = _seconds(
            r,
            "capyctl_ready_wait_seconds",
            "How long requests that found their model not ready waited for it (a start or a "
            "wake): the delay a request for a parked or stopped model feels.",
        )

        self.download_bytes = Counter(
            "capyctl_download_bytes",
            "Bytes of models received from the Hub, by host and repository.",
            ["host", "repo"],
            registry=r,
        )
        self.download_s = Histogram(
            "capyctl_download_seconds",
            "Model downloads from the Hub, from their start to their end, by how they ended.",
            ["host", "repo", "outcome"],
            buckets=DOWNLOAD_SECONDS,
            registry=r,
        )

    def outcome(self, deployment: str, outcome: str, route: str) -> None:
        self.requests.labels(deployment, outcome, route).inc()

    def set_waiting(self, deployment: str, count: int) -> None:
        self.waiting.labels(deployment).set(count)

    def queue_wait(self, deployment: str, seconds: float) -> None:
        self.queue_wait_s.labels(deployment).observe(seconds)

    def ready_wait(self, deployment: str, seconds: float) -> None:
        self.ready_wait_s.labels(deployment).observe(seconds)

    def first_output(self, deployment: str, seconds: float) -> None:
        self.ttft_s.labels(deployment).observe(seconds)

    def cancelled(self, deployment: str) -> None:
        self.cancellations.labels(deployment).inc()

    def queue_full(self, deployment: str) -> None:
        self.queue_fulls.labels(deployment).inc()

    def render(
        self, gpus: GpuMemory | None = None, refused: Mapping[tuple[str, str], int] | None = None
    ) -> bytes:
        """This process's metrics, or every worker's in multiprocess mode, the GPUs'
        memory of `gpus` (the scheduler's last summary), and the control plane's `refused`
        values by host and kind."""
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if folder is None:
            text = generate_latest(self.registry)
        else:
            every = CollectorRegistry()
            MultiProcessCollector(every, folder)  # type: ignore[no-untyped-call]
            text = generate_latest(every)
        ledger = CollectorRegistry()
        ledger.register(GpuCollector(gpus))
        ledger.register(RefusedCollector(refused or {}))
        return text + generate_latest(ledger)

    async def scrape(self, state: State) -> bytes:
        """`render` with the scheduler's summary of the GPUs' memory, read now (one GET);
        without it when Redis does not answer."""
        try:
            gpus, refused = await asyncio.gather(state.gpu_memory.get(), state.refusals.counts())
        except (*REDIS_ERRORS, ValidationError):
            gpus, refused = None, None
        return self.render(gpus, refused)

    async def follow_events(
        self,
        state: State,
        hosts: Callable[[], set[str]],
        stop: asyncio.Event,
        folder: Path | None = None,
    ) -> None:
        """Observe each start, wake, park and download as hostd reports it, on every host the
        routing table knows (a server may have none yet), and each switch and eviction as the
        scheduler's choice stream reports it.

        With the workers' metrics `folder`, the events are read from the router's start on,
        and how far they were read is kept there: a worker that starts again goes on from
        where its predecessor stopped, so no event is missed or counted twice. Without it,
        from now on."""
        cursors = Cursors.read(folder)
        await asyncio.gather(
            self._follow_hosts(state, hosts, stop, cursors),
            self._follow_choices(state, stop, cursors),
        )

    async def _follow_hosts(
        self,
        state: State,
        hosts: Callable[[], set[str]],
        stop: asyncio.Event,
        cursors: Cursors,
    ) -> None:
        while not stop.is_set():
            for host in hosts():
                cursors.hosts.setdefault(host, cursors.start)
            if not cursors.hosts:
                await wait_event(stop, 1.0)
                continue
            try:
                found = await state.events.after(cursors.hosts, count=100, block_ms=1000)
            except REDIS_ERRORS:
                await wait_event(stop, 1.0)
                continue
            for host, entry_id, event in found:
                cursors.hosts[host] = entry_id
                if event is not None:
                    self._event(event)
            if found:
                cursors.keep()

    async def _follow_choices(self, state: State, stop: asyncio.Event, cursors: Cursors) -> None:
        while not stop.is_set():
            cursor = cursors.choices or cursors.start
            try:
                found = await state.choices.after(cursor, count=100, block_ms=1000)
            except REDIS_ERRORS:
                await wait_event(stop, 1.0)
                continue
            for entry_id, choice in found:
                cursors.choices = entry_id
                if choice is not None:
                    self._choice(choice)
            if found:
                cursors.keep()

    def _choice(self, choice: Choice) -> None:
        if choice.kind == "evicted" and choice.cause is not None:
            self.evictions.labels(choice.deployment, choice.cause).inc()
        elif choice.kind == "switched" and choice.duration_s is not None:
            self.lifecycle.observe(choice.deployment, "switch", choice.duration_s, choice.engine_s)

    def _event(self, event: Event) -> None:
        if event.kind == "download" and event.repo and event.outcome:
            self.download_bytes.labels(event.host, event.repo).inc(event.received_bytes or 0)
            if event.duration_s is not None:
                self.download_s.labels(event.host, event.repo, event.outcome).observe(
                    event.duration_s
                )
            return
        operation = OPERATIONS.get((event.from_state or "", event.to_state or ""))
        if operation is None or event.duration_s is None:
            return
        self.lifecycle.observe(event.deployment, operation, event.duration_s, event.engine_s)


class RefusedCollector(Collector):
    """The values the control plane refused to believe, by the host whose prefix held them
    ('' for the control plane's own keys) and their kind (`capycommon.state.quarantine`)."""

    def __init__(self, refused: Mapping[tuple[str, str], int]) -> None:
        self.refused = refused

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "capyctl_host_records_refused",
            "Values read from Redis that the control plane refused: malformed, oversized, or "
            "naming another host or a generation the scheduler did not decide; each logged "
            "once with its host.",
            labels=["host", "kind"],
        )
        for (host, kind), count in sorted(self.refused.items()):
            family.add_metric([host, kind], count)
        yield family


class GpuCollector(Collector):
    """What the scheduler's ledger charges on each GPU by phase (every phase, zero when none
    is charged), and each GPU's capacity, managed limit, reserve, parked limit and what
    admission may still take, from the scheduler's summary (none before it wrote one)."""

    def __init__(self, gpus: GpuMemory | None) -> None:
        self.gpus = gpus

    def collect(self) -> Iterator[GaugeMetricFamily]:
        where = ["host", "gpu"]
        memory = GaugeMetricFamily(
            "capyctl_gpu_memory_bytes",
            "What the scheduler's ledger charges on the GPU, by phase: starting, ready (also "
            "draining, parking, stopping), parked, waking; cache: LMCache servers kept for "
            "stopped models; orphan: engines no deployment owns; unknown: engines of a host the "
            "server lost or revoked, which run on as far as anyone knows.",
            labels=[*where, "phase"],
        )
        figures = {
            "capacity": "The GPU's memory.",
            "managed_limit": "The most the scheduler charges on the GPU.",
            "reserve": "What the scheduler keeps free on the GPU.",
            "parked_limit": "The most parked models may keep on the GPU.",
            "free": "What admission may still charge on the GPU: the lower of the managed "
            "limit and the memory less the reserve, less every charge.",
        }
        families = {
            name: GaugeMetricFamily(f"capyctl_gpu_{name}_bytes", text, labels=where)
            for name, text in figures.items()
        }
        for gpu in self.gpus.gpus if self.gpus is not None else ():
            at = [gpu.host, gpu.gpu]
            for phase in get_args(ChargePhase):
                memory.add_metric([*at, phase], gpu.charged.get(phase, 0))
            for name, family in families.items():
                family.add_metric(at, getattr(gpu, name))
        yield memory
        yield from families.values()
