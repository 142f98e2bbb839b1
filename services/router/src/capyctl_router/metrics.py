"""The router's Prometheus metrics: requests per deployment by outcome, running and waiting,
queue wait, the wait for a model to become ready, time to first token, cancellations,
queue_full; and what the hosts' event streams report: start, wake and park durations, the
engine's own part of each and CapyCTL's, and the bytes and durations of model downloads
from the Hub.

The router's workers write theirs into one folder (Prometheus's multiprocess mode, on when
`PROMETHEUS_MULTIPROC_DIR` names it, `capyctl_router.workers`): /metrics sums the counts of
every worker, and the gauges of the live ones.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from capycommon.paths import write_atomic
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state.store import Event, read_host_events

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


def _read_cursors(folder: Path | None) -> tuple[str, dict[str, str]]:
    """Where to read each host's events from: the kept cursors, and where a host not read
    before starts."""
    if folder is not None:
        try:
            kept = json.loads((folder / CURSORS_FILE).read_text())
            return str(kept["start"]), {str(h): str(c) for h, c in kept["hosts"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    return _now_id(), {}


def _now_id() -> str:
    return f"{int(time.time() * 1000)}-0"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "capyctl_requests", "Requests by outcome.", ["deployment", "outcome"], registry=r
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

        def seconds(name: str, documentation: str, *labels: str) -> Histogram:
            """A duration per deployment (and `labels`), in the buckets every one shares."""
            return Histogram(
                name, documentation, ["deployment", *labels], buckets=SECONDS, registry=r
            )

        self.queue_wait_s = seconds("capyctl_queue_wait_seconds", "Time until a place.")
        self.ttft_s = seconds(
            "capyctl_time_to_first_token_seconds", "From arrival to the engine's first output."
        )
        self.cancellations = Counter(
            "capyctl_cancellations", "Requests cut short.", ["deployment"], registry=r
        )
        self.queue_fulls = Counter(
            "capyctl_queue_full", "Requests refused: queue full.", ["deployment"], registry=r
        )
        self.lifecycle_s = seconds(
            "capyctl_lifecycle_seconds",
            "Start, wake and park durations, from the hosts' events.",
            "operation",
        )
        self.lifecycle_engine_s = seconds(
            "capyctl_lifecycle_engine_seconds",
            "The engine's own part of each start, wake and park: its load (from its spawn to "
            "its health), its wake calls, its sleep call.",
            "operation",
        )
        self.lifecycle_overhead_s = seconds(
            "capyctl_lifecycle_overhead_seconds",
            "CapyCTL's part of each start, wake and park: all but the engine's own part "
            "(waiting for the GPU, readiness checks, the canary, memory verification).",
            "operation",
        )
        self.ready_wait_s = seconds(
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

    def outcome(self, deployment: str, outcome: str) -> None:
        self.requests.labels(deployment, outcome).inc()

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

    def render(self) -> bytes:
        """This process's metrics, or every worker's in multiprocess mode."""
        folder = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if folder is None:
            return generate_latest(self.registry)
        every = CollectorRegistry()
        MultiProcessCollector(every, folder)  # type: ignore[no-untyped-call]
        return generate_latest(every)

    async def follow_events(
        self,
        client: aioredis.Redis,
        hosts: Callable[[], set[str]],
        stop: asyncio.Event,
        folder: Path | None = None,
    ) -> None:
        """Observe each start, wake, park and download as hostd reports it, on every host the
        routing table knows (a server may have none yet).

        With the workers' metrics `folder`, the events are read from the router's start on,
        and how far they were read is kept there: a worker that starts again goes on from
        where its predecessor stopped, so no event is missed or counted twice. Without it,
        from now on."""
        start, cursors = _read_cursors(folder)
        while not stop.is_set():
            for host in hosts():
                cursors.setdefault(host, start)
            if not cursors:
                await wait_event(stop, 1.0)
                continue
            try:
                found = await read_host_events(client, cursors, count=100, block_ms=1000)
            except REDIS_ERRORS:
                await wait_event(stop, 1.0)
                continue
            for host, entry_id, event in found:
                cursors[host] = entry_id
                if event is not None:
                    self._event(event)
            if found and folder is not None:
                write_atomic(folder / CURSORS_FILE, json.dumps({"start": start, "hosts": cursors}))

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
        self.lifecycle_s.labels(event.deployment, operation).observe(event.duration_s)
        if event.engine_s is not None:
            engine = min(event.engine_s, event.duration_s)
            self.lifecycle_engine_s.labels(event.deployment, operation).observe(engine)
            overhead = event.duration_s - engine
            self.lifecycle_overhead_s.labels(event.deployment, operation).observe(overhead)
