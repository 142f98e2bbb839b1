"""A hostile joined host, on real roles: a server with hosts `ha` and `hb`, a deployment `s1`
pinned to `hb` and serving, and `ha`'s own credentials (its certificate, its Redis user and
password) driven by a hypothesis strategy that writes whatever it likes under `ha`'s prefix:
forged instance records (other hosts' names, huge generations, any state, under any name),
bad JSON, binary and oversized values of every kind the control plane reads, notifications
that announce them, an ingress pointed at a listener `ha` controls, and scripts.

Throughout, requests for `s1` keep coming and the management API is asked every quarter
second. What must hold: `s1` never leaves `hb`, its engine there never stops, no request
reaches `ha`'s listener, every request for `s1` is served, no service restarts, and the
management API answers each time within 1 s (within twice its slowest answer before the
attack, on a machine so loaded that it was slower than half a second already).

Forged records name no process: every host of this test runs on one machine, so a record
naming `hb`'s engine's PID would make `ha`'s own hostd stop it, which on real machines it
could not reach.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.exceptions import RedisError

from capycommon.domain.instances import InstanceState
from capycommon.state import keys
from hostilehost import Hostile, forged_record, refused_by_metrics
from serversetup import ask
from support import wait_for

# Three roles start for this file, and a few hundred hostile writes run on them.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


@dataclass
class Watch:
    """Requests for s1 and management reads, sent the whole run long from threads."""

    served: int = 0
    failed: list[str] = field(default_factory=list)
    # How long each management read took before ha began to write, and since.
    quiet_s: list[float] = field(default_factory=list)
    attacked_s: list[float] = field(default_factory=list)
    attacking: bool = False
    stop: threading.Event = field(default_factory=threading.Event)


# What ha writes -------------------------------------------------------------------------

KINDS = ("memory", "info", "engines", "models", "heartbeat:hostd", "heartbeat:memwatch")
TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
JUNK = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"{not json", b"[]", b"null", b"1e999", b'{"a":' * 200, b"\xff\xfe"]),
    st.builds(lambda depth: b"[" * depth + b"]" * depth, st.integers(1, 5000)),
)
# Over the 1 MiB the readers parse (and under the 8 MiB Redis takes): written only to the
# few keys of KINDS, so that ha stays within its quota of the server's memory.
HUGE = JUNK | st.just(b"x" * (2 << 20))


FORGED = st.builds(
    forged_record,
    st.fixed_dictionaries(
        {},
        optional={
            "deployment": st.sampled_from(["s1", "s2", ""]) | TEXT,
            "instance": st.integers(-1, 3),
            "generation": st.integers(0, 2**62) | st.sampled_from([1, 2, 50]),
            "host": st.sampled_from(["ha", "hb", "", "HB"]) | TEXT,
            "state": st.sampled_from([s.value for s in InstanceState]),
            "port": st.integers(0, 70000),
        },
    ),
)


@st.composite
def writes(draw: st.DrawFn) -> list[tuple[str, Any]]:
    """A few of ha's writes, each (what, arguments)."""
    steps: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["record", "kind", "load", "ingress", "notify", "script"]))
        if what == "record":
            member = draw(st.sampled_from(["s1:0", "s2:0", "s1:1"]) | TEXT)
            steps.append((what, (member, draw(FORGED | JUNK))))
        elif what == "kind":
            steps.append((what, (draw(st.sampled_from(KINDS)), draw(HUGE))))
        elif what == "load":
            steps.append((what, (draw(TEXT), draw(JUNK))))
        elif what == "notify":
            steps.append((what, draw(st.sampled_from(["instance", "host", "load"]))))
        else:
            steps.append((what, None))
    return steps


def apply(hostile: Hostile, client: redis.Redis, step: tuple[str, Any]) -> None:
    """One write of ha's, as its own user may send it; what Redis refuses is refused."""
    what, args = step
    prefix = keys.host_prefix("ha")
    send: Callable[..., Any] = client.execute_command
    with contextlib.suppress(RedisError):
        if what == "record":
            member, value = args
            send("SET", f"{prefix}:instance:{member}", value)
            send("SADD", keys.instances("ha"), member)
            note = {"kind": "instance", "id": member, "version": 50}
            send("PUBLISH", keys.host_notifications("ha"), json.dumps(note))
        elif what == "kind":
            kind, value = args
            send("SET", f"{prefix}:{kind}", value)
        elif what == "load":
            member, value = args
            send("HSET", keys.engine_load("ha"), member or "s1:0", value)
        elif what == "ingress":
            assert hostile.listener is not None
            info = json.dumps({"ingress": hostile.listener.address})
            send("SET", keys.host_info("ha"), info)
        elif what == "notify":
            note = {"kind": args, "id": "s1:0" if args == "instance" else "ha", "version": 1}
            send("PUBLISH", keys.host_notifications("ha"), json.dumps(note))
        else:
            send("EVAL", "local i = 0 while true do i = i + 1 end", "0")


# The run --------------------------------------------------------------------------------


def _keep_asking(hostile: Hostile, watch: Watch) -> None:
    client = hostile.openai(timeout=30)
    while not watch.stop.is_set():
        try:
            ask(client, "s1")
            watch.served += 1
        except openai.OpenAIError as exc:
            watch.failed.append(f"s1: {exc!r}")


def _keep_reading_management(hostile: Hostile, watch: Watch) -> None:
    token = hostile.server.credentials()["admin_token"]
    url = f"http://{hostile.server.management}/management/v1/deployments"
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=5) as client:
        while not watch.stop.wait(0.25):
            began = time.monotonic()
            try:
                answer = client.get(url)
                took = time.monotonic() - began
                (watch.attacked_s if watch.attacking else watch.quiet_s).append(took)
                if answer.status_code != 200:
                    watch.failed.append(f"management: {answer.status_code} {answer.text[:200]}")
            except httpx.HTTPError as exc:
                watch.failed.append(f"management: {exc!r}")


@pytest.fixture
def watched(hostile: Hostile) -> Iterator[Watch]:
    watch = Watch()
    threads = [
        threading.Thread(target=_keep_asking, args=(hostile, watch), daemon=True),
        threading.Thread(target=_keep_reading_management, args=(hostile, watch), daemon=True),
    ]
    for thread in threads:
        thread.start()
    try:
        yield watch
    finally:
        watch.stop.set()
        for thread in threads:
            thread.join(timeout=60)


def test_a_hostile_host_moves_nothing_stops_nothing_and_reaches_no_prompt(
    hostile: Hostile, watched: Watch
) -> None:
    before = hostile.s1()
    beats = hostile.beats()
    assert set(beats) >= {"router", "scheduler", "hostd@hb", "memwatch@hb"}
    client = hostile.as_host("ha")
    # The management API's pace on this machine now, before ha writes anything: on a machine
    # so busy that it is slow already, ha must not make it slower than twice that.
    wait_for(lambda: len(watched.quiet_s) >= 12, 60, "a dozen quiet management reads")
    watched.attacking = True

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(writes())
    def ha_writes(steps: list[tuple[str, Any]]) -> None:
        for step in steps:
            apply(hostile, client, step)
            hostile.tried += 1
        now = hostile.s1()
        assert (now.generation, now.state, now.process) == (
            before.generation,
            InstanceState.READY,
            before.process,
        )
        assert hostile.placed() == "hb"
        assert hostile.listener is not None
        assert hostile.listener.accepted == 0

    try:
        ha_writes()
    finally:
        client.close()
    # What ha wrote last has been read and weighed (the router re-reads its table every
    # 5 s): the count has moved, and still nothing else has.
    refused = wait_for(
        lambda: refused_by_metrics(hostile) or None, 30, "the refusals to be counted"
    )
    served_before = watched.served
    wait_for(lambda: watched.served > served_before, 30, "s1 to serve once more")
    watched.stop.set()
    assert watched.failed == []
    slowest, quiet = max(watched.attacked_s), max(watched.quiet_s)
    assert slowest < max(1.0, 2 * quiet), (slowest, quiet)
    assert hostile.s1().generation == before.generation
    assert hostile.placed() == "hb"
    assert hostile.listener is not None
    assert hostile.listener.accepted == 0
    after = hostile.beats()
    restarted = {name for name, beat in beats.items() if after.get(name) != beat}
    assert restarted == set()
    print(
        f"\nhostile host: {hostile.tried} writes tried, {refused} values refused, "
        f"{watched.served} requests for s1 served, {len(watched.attacked_s)} management "
        f"reads (slowest {slowest * 1000:.0f} ms; {quiet * 1000:.0f} ms before), "
        f"services restarted: {len(restarted)}"
    )
