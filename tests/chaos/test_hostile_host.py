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
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import openai
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from capycommon.state import keys
from capycommon.state.heartbeats import Heartbeat
from capycommon.state.instances import InstanceRecord, InstanceState
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from serversetup import ServerSetup
from support import (
    Role,
    capyctl,
    clean_env,
    free_port,
    join_host,
    short_dir,
    start_host,
    start_role,
    wait_for,
)

GiB = 1 << 30
SMALL = {"memory": {"request": "4GiB"}}
HOSTS = {"ha": "127.0.0.4", "hb": "127.0.0.5"}
SERVICES = ("router", "scheduler")
HOST_SERVICES = ("hostd", "memwatch")

# Three roles start for this file, and a few hundred hostile writes run on them.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


@dataclass
class Listener:
    """A TCP listener `ha` controls, counting the connections it is sent."""

    sock: socket.socket
    accepted: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    def serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                connection, _ = self.sock.accept()
                self.accepted += 1
                connection.close()


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


@dataclass
class Hostile(ServerSetup):
    hosts: dict[str, Role] = field(default_factory=dict)
    listener: Listener | None = None
    tried: int = 0

    def as_host(self, host: str) -> redis.Redis:
        """The server's Redis as `host`'s user, with its certificate and password."""
        state = self.folder / host / "state" / "identity"
        joined = json.loads((state / "joined.json").read_text())
        address, port = joined["redis_address"].rsplit(":", 1)
        return redis.Redis(
            host=address,
            port=int(port),
            ssl=True,
            ssl_certfile=str(state / "host.pem"),
            ssl_ca_certs=str(state / "server-ca.pem"),
            ssl_cert_reqs="required",
            protocol=2,
            retry=Retry(NoBackoff(), 0),
            socket_timeout=10,
            username=joined["redis_user"],
            password=joined["redis_password"],
        )

    def s1(self) -> InstanceRecord:
        raw = cast(bytes, self.redis.get(keys.instance("hb", "s1", 0)))
        return InstanceRecord.model_validate_json(raw)

    def placed(self) -> str | None:
        raw = cast(bytes, self.redis.get(keys.deployment("s1")))
        found: str | None = json.loads(raw).get("host")
        return found

    def beats(self) -> dict[str, tuple[int, float]]:
        """Each service's pid and start, from its heartbeat: the control plane's, and hb's
        (ha's own heartbeats are among what ha overwrites)."""
        named = {f"{s}": keys.heartbeat(s, "") for s in SERVICES}
        named |= {f"{s}@hb": keys.heartbeat(s, "hb") for s in HOST_SERVICES}
        found = {}
        for name, key in named.items():
            raw = cast(bytes | None, self.redis.get(key))
            if raw is not None:
                with contextlib.suppress(ValueError):
                    beat = Heartbeat.model_validate_json(raw)
                    found[name] = (beat.pid, beat.started_at)
        return found


@pytest.fixture(scope="module")
def hostile() -> Iterator[Hostile]:
    folder = short_dir("hostile")
    server = start_role("server", env=clean_env(HOME=str(folder)))
    found = Hostile(folder, server)
    fast = Behaviour(load_seconds=0.2, tokens_per_second=400)
    engine = install_python_engine(folder / "e" / "vllm", "vllm", "0.29.0", fast)
    sock = socket.socket()
    sock.bind((HOSTS["ha"], 0))  # the port is ha's own, reserved for the whole test
    sock.listen(64)
    found.listener = Listener(sock)
    serving = threading.Thread(target=found.listener.serve, daemon=True)
    serving.start()
    try:
        for name, address in HOSTS.items():
            home = folder / name
            state = home / "state"
            home.mkdir(parents=True)
            join_host(server, name, state)
            added = capyctl(
                "engine", "add", str(engine), "--name", "vllm", "--state-dir", str(state),
                env=clean_env(HOME=str(home)),
            )  # fmt: skip
            assert added.returncode == 0, added.stderr
            sparse_model(home / "models" / "small", 2 * GiB)
            found.hosts[name] = start_host(
                state,
                ports_base=24300 if name == "ha" else 24400,
                env={"HOME": str(home), "CAPYCTL_HOST_INGRESS_BIND": f"{address}:{free_port()}"},
            )
        found.deploy("s1", model="small", engine_config=SMALL, placement={"hosts": ["hb"]})
        ask(found.openai(timeout=180), "s1")  # the first starts its engine
        yield found
    finally:
        found.listener.stop.set()
        serving.join(timeout=5)
        sock.close()
        found.close_clients()
        for role in found.hosts.values():
            role.stop()
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def ask(client: openai.OpenAI, model: str) -> str:
    messages: Any = [{"role": "user", "content": "hello"}]
    answer = client.chat.completions.create(model=model, messages=messages, max_tokens=4)
    return answer.choices[0].message.content or ""


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


def _record(values: dict[str, Any]) -> bytes:
    record = {
        "deployment": "s1",
        "instance": 0,
        "revision": 1,
        "generation": 1,
        "state": "ready",
        "since": time.time(),
        "host": "ha",
        "port": 8100,
        "family": "vllm",
        "served_name": "s1",
    }
    return json.dumps(record | values).encode()


FORGED = st.builds(
    _record,
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


def refused_by_metrics(hostile: Hostile) -> int:
    key = hostile.server.credentials()["api_key"]
    text = httpx.get(
        f"http://{hostile.server.inference}/metrics",
        headers={"Authorization": f"Bearer {key}"},
        timeout=10,
    ).text
    return sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith('capyctl_host_records_refused_total{host="ha"')
    )


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


# The report's findings, each replayed as it was done -------------------------------------


def _as_ha(hostile: Hostile) -> Iterator[Callable[..., Any]]:
    client = hostile.as_host("ha")
    try:
        yield client.execute_command
    finally:
        client.close()


@pytest.fixture
def ha(hostile: Hostile) -> Iterator[Callable[..., Any]]:
    """One command at a time, as ha's own user sends it."""
    yield from _as_ha(hostile)


def test_the_reported_takeover_moves_nothing_and_reaches_no_prompt(
    hostile: Hostile, ha: Callable[..., Any]
) -> None:
    """ha writes hb's record of s1 as its own, at generation 50, lists it, points its ingress
    at its own listener and announces both: the takeover of the report."""
    assert hostile.listener is not None
    before = hostile.s1()
    counted = refused_by_metrics(hostile)
    ha("SET", keys.instance("ha", "s1", 0), _record({"generation": 50}))
    ha("SADD", keys.instances("ha"), "s1:0")
    ha("SET", keys.host_info("ha"), json.dumps({"ingress": hostile.listener.address}))
    ha(
        "PUBLISH",
        keys.host_notifications("ha"),
        '{"kind": "instance", "id": "s1:0", "version": 50}',
    )
    ha("PUBLISH", keys.host_notifications("ha"), '{"kind": "host", "id": "ha", "version": 0}')
    wait_for(lambda: refused_by_metrics(hostile) > counted, 30, "the forged record refused")
    client = hostile.openai()
    for _ in range(3):
        assert ask(client, "s1")
    assert hostile.s1().generation == before.generation
    assert hostile.placed() == "hb"
    assert hostile.listener.accepted == 0
    listed = hostile.ok("list", "deployments")
    assert "s1" in listed
    assert "hb" in listed.split("s1", 1)[1].splitlines()[0]


@pytest.mark.parametrize(
    "kind", ["instance", "memory", "info", "engines", "models", "engine-load", "unknown-host"]
)
def test_one_malformed_key_stops_no_service(
    hostile: Hostile, ha: Callable[..., Any], kind: str
) -> None:
    """Bad JSON in each key the control plane reads, or a valid record naming a host nobody
    knows: the report's crash loop of the scheduler."""
    beats = hostile.beats()
    counted = refused_by_metrics(hostile)
    bad = f"{{not json {kind} {time.monotonic_ns()}"

    def write() -> None:
        """Written again until refused: ha's own agents rewrite some of these keys."""
        if kind == "instance":
            ha("SET", keys.instance("ha", "bogus", 0), bad)
            ha("SADD", keys.instances("ha"), "bogus:0")
        elif kind == "unknown-host":
            stranger = _record({"deployment": "bogus", "host": "zz", "port": len(bad)})
            ha("SET", keys.instance("ha", "bogus", 0), stranger)
            ha("SADD", keys.instances("ha"), "bogus:0")
        elif kind == "engine-load":
            ha("HSET", keys.engine_load("ha"), "s1:0", bad)
        else:
            ha("SET", f"{keys.host_prefix('ha')}:{kind}", bad)
        note = '{"kind": "instance", "id": "bogus:0", "version": 1}'
        ha("PUBLISH", keys.host_notifications("ha"), note)

    def refused() -> bool:
        write()
        return refused_by_metrics(hostile) > counted

    wait_for(refused, 30, f"the bad {kind} refused", interval=0.5)
    assert ask(hostile.openai(), "s1")
    assert hostile.ok("list", "deployments")
    assert hostile.beats() == beats


def test_the_router_reads_its_table_again_after_bad_data(hostile: Hostile) -> None:
    """A change no notification announced is still seen by the full read every 5 s, after
    all the bad data above (the report's router stopped re-reading for good)."""
    hostile.deploy("quiet", model="small", engine_config=SMALL, placement={"hosts": ["hb"]})
    key = hostile.server.credentials()["api_key"]
    url = f"http://{hostile.server.inference}/v1/models"

    def listed() -> set[str]:
        answer = httpx.get(url, headers={"Authorization": f"Bearer {key}"}, timeout=10)
        return {model["id"] for model in answer.json()["data"]}

    wait_for(lambda: "quiet" in listed(), 30, "quiet to be listed")
    raw = cast(bytes, hostile.redis.get(keys.deployment("quiet")))
    record = json.loads(raw) | {"stopped": True}
    hostile.redis.set(keys.deployment("quiet"), json.dumps(record))  # and no notification
    wait_for(lambda: "quiet" not in listed(), 30, "the router's full read to see quiet stopped")


def test_a_host_runs_no_script_of_its_own(hostile: Hostile, ha: Callable[..., Any]) -> None:
    """The report's 8 s busy loop: refused before it runs, and everything serves on."""
    with pytest.raises(redis.exceptions.NoPermissionError):
        ha("EVAL", "local i = 0 while true do i = i + 1 end", "0")
    assert ask(hostile.openai(), "s1")
