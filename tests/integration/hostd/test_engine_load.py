"""hostd publishes each serving engine's running and waiting requests, once a second, and
five times a second while one reads busy, saying when it reads idle again."""

from __future__ import annotations

import itertools
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import openai

from capycommon.domain.commands import Park, Stop, Wake
from capycommon.domain.hosts import EngineLoad
from capycommon.domain.instances import InstanceRecord
from capycommon.domain.notifications import Notification
from capycommon.state import keys
from enginesim.install import write_behaviour
from integration.hostd.harness import FAST, HOST, Hostd, launch
from support import wait_for

# 40 tokens at 10 a second: a request that runs for about four seconds.
SLOW = FAST.model_copy(update={"tokens_per_second": 10, "answer": " ".join(["slow"] * 40)})


def _load(harness: Hostd, running: int | None = None) -> EngineLoad | None:
    """a:0's entry; with `running`, only once it shows that many running requests."""
    found = harness.loads().get("a:0")
    return found if found is not None and running in (None, found.running) else None


def _slow(harness: Hostd, gpu: str, model: Path, installs: dict[str, Path]) -> InstanceRecord:
    """a, launched on the slow engine, ready."""
    write_behaviour(installs["vllm"], SLOW)
    harness.send(launch("a", 1, gpu, model))
    return harness.wait_state("a", "ready")


def _asked(pool: ThreadPoolExecutor, harness: Hostd, ready: InstanceRecord) -> Future[str]:
    """One chat sent to a's engine directly; its answer's text."""

    def ask() -> str:
        url = f"http://127.0.0.1:{ready.port}/v1"
        with openai.OpenAI(base_url=url, api_key=harness.secret("a")) as chat:
            answer = chat.chat.completions.create(
                model="a", messages=[{"role": "user", "content": "hi"}]
            )
        return answer.choices[0].message.content or ""

    return pool.submit(ask)


def test_the_load_shows_a_request_while_it_runs_and_goes_with_the_engine(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    ready = _slow(harness, gpu, model, installs)
    idle = wait_for(lambda: _load(harness), timeout=5, what="the first entry")
    assert (idle.generation, idle.running, idle.waiting) == (1, 0, 0)
    assert idle.last_active_at == ready.since, "idle since it became ready"
    assert idle.read_at >= ready.since

    with ThreadPoolExecutor(1) as pool:
        reply = _asked(pool, harness, ready)
        busy = wait_for(lambda: _load(harness, 1), timeout=5, what="the running request")
        assert not reply.done(), "seen while the request ran"
        assert busy.last_active_at == busy.read_at
        assert reply.result(timeout=30)
    after = wait_for(lambda: _load(harness, 0), timeout=5, what="the load back to nothing")
    assert after.waiting == 0
    assert busy.read_at <= after.last_active_at < after.read_at, "last active while it ran"

    harness.send(Park(deployment="a", generation=1))
    harness.wait_state("a", "parked")
    wait_for(lambda: _load(harness) is None, timeout=5, what="no entry while parked")
    harness.send(Wake(deployment="a", generation=1))
    awake = harness.wait_state("a", "ready")
    woken = wait_for(lambda: _load(harness), timeout=5, what="the entry back after the wake")
    assert (woken.running, woken.last_active_at) == (0, awake.since)

    harness.send(Stop(deployment="a", generation=1))
    harness.wait_state("a", "stopped")
    wait_for(lambda: "a:0" not in harness.loads(), timeout=5, what="the entry gone")


def test_a_busy_engine_is_read_often_and_its_idle_reading_is_announced(
    hostd: tuple[Hostd, str], model: Path, installs: dict[str, Path]
) -> None:
    harness, gpu = hostd
    ready = _slow(harness, gpu, model, installs)
    wait_for(lambda: _load(harness), timeout=5, what="the first entry")
    pubsub = harness.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
    pubsub.subscribe(keys.host_notifications(HOST))
    with pubsub, ThreadPoolExecutor(1) as pool:
        reply = _asked(pool, harness, ready)
        busy = wait_for(lambda: _load(harness, 1), timeout=5, what="the running request")
        readings = {busy.read_at}
        while len(readings) < 4 and not reply.done():
            readings |= {found.read_at for found in [_load(harness, 1)] if found is not None}
            time.sleep(0.02)
        assert len(readings) == 4, "read again and again while the request ran"
        gaps = [b - a for a, b in itertools.pairwise(sorted(readings))]
        assert max(gaps) < 0.6, f"read every fifth of a second while busy, not every second: {gaps}"
        assert reply.result(timeout=30)
        while (message := pubsub.get_message(timeout=0.01)) is not None:
            pass  # what was said while it ran
        idle = wait_for(lambda: _load(harness, 0), timeout=5, what="the idle reading")
        said: list[Notification] = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(n.kind == "load" for n in said):
            message = pubsub.get_message(timeout=0.1)
            if message is not None:
                said.append(Notification.model_validate_json(message["data"]))
        assert any(n.kind == "load" for n in said), "its idle reading is announced"
        assert idle.read_at - busy.read_at < 5
    # Idle, it is read once a second again.
    first = wait_for(lambda: _newer(harness, idle), timeout=5, what="an idle reading")
    second = wait_for(lambda: _newer(harness, first), timeout=5, what="the next idle reading")
    assert second.read_at - first.read_at > 0.8


def _newer(harness: Hostd, than: EngineLoad) -> EngineLoad | None:
    found = _load(harness, 0)
    return found if found is not None and found.read_at > than.read_at else None


def test_an_engine_that_does_not_answer_keeps_its_entry(
    hostd: tuple[Hostd, str], model: Path
) -> None:
    harness, gpu = hostd
    harness.send(launch("a", 1, gpu, model))
    harness.send(launch("b", 1, gpu, model))
    frozen = harness.wait_state("a", "ready")
    harness.wait_state("b", "ready")
    assert frozen.process is not None
    wait_for(lambda: "b:0" in harness.loads(), timeout=5, what="b's entry")
    before = wait_for(lambda: _load(harness), timeout=5, what="a's entry")
    os.killpg(frozen.process.pgid, signal.SIGSTOP)  # its metrics go unanswered
    try:
        stopped_at = time.time()
        wait_for(
            lambda: harness.loads()["b:0"].read_at > stopped_at + 2,
            timeout=10,
            what="b read twice more",
        )
        assert harness.loads()["a:0"] == before, "a keeps the entry it had"
    finally:
        os.killpg(frozen.process.pgid, signal.SIGCONT)
    wait_for(lambda: _load(harness) != before, timeout=10, what="a read again")
