"""The router through failures under steady load, end to end: `capyctl start standalone`,
the engine simulator, and a few threads sending requests through the openai SDK (no retries,
so every failure shows). Redis killed and restarted: every request ends 200 or 503 with
Retry-After, no place is left taken, a switch afterwards is not blocked, and each router
process says so once. A router worker killed: only its requests in flight fail, new ones are
served at once, it is started again, and its places are given back."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import pytest

from cluster import FOURTEEN, SMALL, Cluster, running
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from support import wait_for

HI: list[Any] = [{"role": "user", "content": "hi"}]
THREADS = 4
ROUTER_PROCESSES = {"router", "router-0", "router-1"}


@pytest.fixture(scope="module")
def one_gpu() -> Iterator[Cluster]:
    """The cluster, with an engine that takes about half a second a request: a kill always
    finds requests on their way."""
    with running("resilience") as cluster:
        answer = " ".join(["word"] * 20)
        behaviour = Behaviour(load_seconds=0.5, tokens_per_second=40, answer=answer)
        install = install_python_engine(cluster.root / "e" / "steady", "vllm", "0.29.0", behaviour)
        cluster.ok("engine", "add", str(install), "--name", "steady")
        yield cluster


@dataclass(frozen=True)
class Outcome:
    started: float
    ended: float
    result: str  # "200", "503", ... or the name of the exception (a broken connection)
    retry_after: str | None = None


@dataclass
class Load:
    """THREADS threads sending requests for `model`, one after another, half streamed."""

    cluster: Cluster
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    @contextmanager
    def running(self) -> Iterator[None]:
        threads = [threading.Thread(target=self._send, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        try:
            yield
        finally:
            self.stop.set()
            for thread in threads:
                thread.join(timeout=60)

    def _send(self, index: int) -> None:
        with openai.OpenAI(
            base_url=self.cluster.base_url, api_key=self.cluster.api_key, timeout=30, max_retries=0
        ) as client:
            self._send_with(client, index)

    def _send_with(self, client: openai.OpenAI, index: int) -> None:
        stream = index % 2 == 0
        while not self.stop.is_set():
            started = time.monotonic()
            result, retry_after = _ask(client, self.model, stream)
            self.outcomes.append(Outcome(started, time.monotonic(), result, retry_after))

    def counts(self) -> Counter[str]:
        return Counter(outcome.result for outcome in self.outcomes)

    def report(self, what: str, at: float) -> None:
        """The figures, for `pytest -s`: sent, succeeded, failed by status, and recovery (the
        first success of a request sent after `at`)."""
        counts = self.counts()
        after = [o.ended for o in self.outcomes if o.started > at and o.result == "200"]
        recovery = f"{min(after) - at:.2f} s" if after else "never"
        failed = {result: n for result, n in counts.items() if result != "200"}
        print(
            f"\n{what}: sent {len(self.outcomes)}, succeeded {counts['200']}, failed {failed}, "
            f"recovery {recovery}"
        )


def _ask(client: openai.OpenAI, model: str, stream: bool) -> tuple[str, str | None]:
    """How one request ended: its status (and Retry-After), or what broke it."""
    try:
        answer = client.chat.completions.create(model=model, messages=HI, stream=stream)
        if isinstance(answer, openai.Stream):
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        else:
            text = answer.choices[0].message.content or ""
    except openai.APIStatusError as exc:
        return str(exc.status_code), exc.response.headers.get("Retry-After")
    except Exception as exc:  # a broken connection, or a stream cut short
        return type(exc).__name__, None
    return ("200" if text else "empty answer"), None


def _running_places(cluster: Cluster, model: str) -> int:
    return cluster.places(model).running


def _router_warnings(cluster: Cluster, offset: int) -> dict[str, list[str]]:
    """The warnings each router process logged after `offset` in the router's log."""
    found: dict[str, list[str]] = {}
    with _router_log(cluster).open(encoding="utf-8", errors="replace") as log:
        log.seek(offset)
        for line in log:
            if not line.startswith("{"):
                continue
            entry = json.loads(line)
            if entry["level"] == "warning" and entry["service"] in ROUTER_PROCESSES:
                found.setdefault(entry["service"], []).append(entry["message"])
    return found


def _router_log(cluster: Cluster) -> Path:
    return cluster.role.state_dir / "logs" / "router.log"


def _killed_during(load: Load, seconds: float, pid: int) -> float:
    """Run `load` for `seconds`, killing `pid` (SIGKILL) after a third of them; when."""
    with load.running():
        time.sleep(seconds / 3)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(seconds * 2 / 3)
    return killed


def test_a_redis_restart_under_load_fails_no_request_and_leaks_no_place(
    cluster: Cluster,
) -> None:
    cluster.deploy("steady", engine="steady", engine_config=FOURTEEN)
    cluster.deploy("next", engine_config=FOURTEEN)
    cluster.start("steady")
    offset = _router_log(cluster).stat().st_size
    before = cluster.role.processes()["redis"]["pid"]
    load = Load(cluster, "steady")
    killed = _killed_during(load, 10, before)
    load.report("Redis killed under load", killed)
    assert cluster.role.processes()["redis"]["pid"] != before, "supervisord restarted Redis"
    assert set(load.counts()) <= {"200", "503"}, "answered, or 503 to retry; never a 500"
    assert all(o.retry_after for o in load.outcomes if o.result == "503")
    assert load.counts()["200"] > 0
    wait_for(lambda: _running_places(cluster, "steady") == 0, timeout=10, what="every place back")
    switched = time.monotonic()
    with openai.OpenAI(base_url=cluster.base_url, api_key=cluster.api_key, max_retries=0) as client:
        answer = client.chat.completions.create(model="next", messages=HI, timeout=90)
    assert answer.choices[0].message.content
    print(f"the switch to another model after it: {time.monotonic() - switched:.1f} s")
    warnings = _router_warnings(cluster, offset)
    print(f"the router's warnings: {warnings}")
    assert warnings, "the outage was told"
    assert all(said == ["lost Redis; reconnecting"] for said in warnings.values()), (
        "one warning per router process, not one per request"
    )


def test_a_killed_router_worker_loses_only_its_own_requests(cluster: Cluster) -> None:
    cluster.deploy("busy", engine="steady", model="small", engine_config=SMALL)
    cluster.start("busy")
    workers = {w["name"]: w for w in cluster.role.processes()["router"]["workers"]}
    assert set(workers) == {"router-0", "router-1"}
    assert {w["state"] for w in workers.values()} == {"RUNNING"}
    victim = workers["router-1"]["pid"]
    load = Load(cluster, "busy")
    killed = _killed_during(load, 9, victim)
    load.report("a router worker killed under load", killed)
    failed = [o for o in load.outcomes if o.result != "200"]
    assert len(failed) <= THREADS, "at most the requests in flight"
    assert all(o.started < killed for o in failed), "only requests sent before the kill failed"
    assert any(o.started > killed for o in load.outcomes), "requests were sent after it"

    def restarted() -> dict[str, Any] | None:
        found = {w["name"]: w for w in cluster.role.processes()["router"]["workers"]}
        again = found.get("router-1")
        live = again is not None and again["pid"] != victim and again["state"] == "RUNNING"
        return again if live else None

    again = wait_for(restarted, timeout=15, what="the worker to be started again")
    print(f"router-1 started again: pid {victim} -> {again['pid']}")
    wait_for(lambda: _running_places(cluster, "busy") == 0, timeout=5, what="every place back")


def test_a_signal_to_one_worker_ends_only_that_worker(cluster: Cluster) -> None:
    """A worker is a fork of the router's parent: a SIGTERM to it ends it alone, and it is
    forked again; the parent and the other worker go on."""
    before = cluster.role.processes()["router"]
    workers = {w["name"]: w["pid"] for w in before["workers"]}
    os.kill(workers["router-0"], signal.SIGTERM)

    def again() -> bool:
        now = cluster.role.processes()["router"]
        found = {w["name"]: w for w in now["workers"]}
        new = found.get("router-0")
        return bool(new and new["pid"] != workers["router-0"] and new["state"] == "RUNNING")

    wait_for(again, timeout=15, what="router-0 to be started again")
    after = cluster.role.processes()["router"]
    assert after["pid"] == before["pid"], "the parent goes on"
    assert {w["name"]: w["pid"] for w in after["workers"]}["router-1"] == workers["router-1"]
    assert cluster.role.healthy()
