"""The host stand-in (`enginesim/standin.py`, the fleet benchmark's hosts) is a host the
server cannot tell from a real one on the wire: a real server with a real joined host (hostd
and memwatch on a simulated GPU, the engine simulator as vLLM) and a stand-in joined the same
way, each given a deployment, started and stopped. Under each host's prefix the same keys
with the same types and expiries, the same event sequence with the same reasons, the same
notification kinds, and records with the same fields."""

from __future__ import annotations

import asyncio
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from capycommon.domain.instances import Event, InstanceRecord
from capycommon.engines.registry import PublishedEngines
from capycommon.paths import StatePaths
from capycommon.redistarget import joined_target
from capycommon.service import redis_client
from capycommon.state import keys
from capycommon.state.stores import State
from capyctl_cli.management import Management
from capyctl_cli.management import wait_for as wait_until
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from enginesim.standin import HostPlan, StandInHost
from support import (
    Role,
    join_host,
    join_with_engines,
    poll,
    short_dir,
    start_host,
    start_role,
    wait_for,
)

pytestmark = pytest.mark.slow

GiB = 1 << 30
REAL, STAND_IN = "real", "stand"
# What the stand-in leaves out, said in its docstring: an engine log kept in Redis (its
# records name no log file).
LEFT_OUT = {"instance-log:<d>:0"}


class Notes:
    """Every notification on the hosts' channels, as (host, kind), heard as the control
    plane's user in a thread of its own."""

    def __init__(self, client: redis.Redis) -> None:
        self.pubsub = client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        self.pubsub.psubscribe("capyctl:host:*:notify")
        self.heard: set[tuple[str, str]] = set()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._listen, daemon=True)
        self.thread.start()

    def _listen(self) -> None:
        while not self.stopped.is_set():
            message = self.pubsub.get_message(timeout=0.2)
            if message is None:
                continue
            host = message["channel"].decode().split(":")[2]
            kind = re.search(rb'"kind":"([a-z-]+)"', message["data"])
            if kind is not None:
                self.heard.add((host, kind[1].decode()))

    def kinds(self, host: str) -> set[str]:
        return {kind for name, kind in self.heard if name == host}

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        self.pubsub.close()


@pytest.fixture
def folder() -> Iterator[Path]:
    made = short_dir("standin")
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _shape(client: redis.Redis, host: str, deployment: str) -> dict[str, tuple[str, bool]]:
    """Each key under the host's prefix, its name with the host and the deployment written
    `<h>` and `<d>` (and a startup peak's revision and fingerprint `<r>` and `<f>`): its type
    and whether it expires."""
    prefix = keys.host_prefix(host)
    found = {}
    for raw in cast(list[bytes], client.keys(f"{prefix}:*")):
        name = raw.decode()[len(prefix) + 1 :].replace(deployment, "<d>")
        name = re.sub(r"^startup-peak:<d>:\d+:.*$", "startup-peak:<d>:<r>:<f>", name)
        kind = cast(bytes, client.type(raw)).decode()
        found[name] = (kind, client.ttl(raw) > 0)
    return found


def _events(client: redis.Redis, host: str) -> list[tuple[str, str | None, str | None, str]]:
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], client.xrange(keys.host_events(host)))
    events = [Event.model_validate_json(fields[b"event"]) for _, fields in entries]
    return [(e.kind, e.from_state, e.to_state, e.reason) for e in events]


def _record(client: redis.Redis, host: str, deployment: str) -> InstanceRecord:
    raw = cast(bytes, client.get(keys.instance(host, deployment, 0)))
    return InstanceRecord.model_validate_json(raw)


def _run_stand_in(state: Path, plan: HostPlan, stop: threading.Event) -> None:
    async def serve() -> None:
        client = redis_client(joined_target(StatePaths(state)))
        ended = asyncio.Event()
        try:
            host = asyncio.create_task(StandInHost(State(client), plan).run(ended))
            await asyncio.to_thread(stop.wait)
            ended.set()
            await host
        finally:
            await client.aclose()

    asyncio.run(serve())


def test_the_server_cannot_tell_the_stand_in_from_a_real_host(folder: Path) -> None:
    server = start_role("server")
    control = server.control()
    notes = Notes(control)
    real: Role | None = None
    stop = threading.Event()
    stand_in = threading.Thread(target=lambda: None)
    try:
        fast = Behaviour(load_seconds=0.3, tokens_per_second=200)
        installs = {"vllm": install_python_engine(folder / "e", "vllm", "0.29.0", fast)}
        real_state = join_with_engines(server, REAL, folder / REAL, installs)
        sparse_model(folder / REAL / "models" / "m1", 2 * GiB)
        real = start_host(real_state, gpus="gpu0:80GiB", env={"HOME": str(folder / REAL)})
        published = wait_for(lambda: control.get(keys.engines(REAL)), 30, "the real engines")
        engines = PublishedEngines.model_validate_json(cast(bytes, published))
        (folder / STAND_IN).mkdir()
        join_host(server, STAND_IN, folder / STAND_IN / "state")
        plan = HostPlan(
            STAND_IN,
            tuple(engines.profiles),
            gpus=1,
            models={"m1": 2 * GiB},
            pace={"ready": 0.5},
        )
        stand_in = threading.Thread(
            target=_run_stand_in, args=(folder / STAND_IN / "state", plan, stop), daemon=True
        )
        stand_in.start()
        with Management(StatePaths(server.state_dir)) as api:
            for host in (REAL, STAND_IN):
                name = f"d-{host}"
                document = {"name": name, "engine": "vllm", "model": "m1"}
                api.deploy(
                    document
                    | {
                        "placement": {"hosts": [host]},
                        "engine_config": {"memory": {"request": "4GiB"}},
                    }
                )
                since = time.time()
                api.act(name, "start")
                wait_until(api, name, lambda s: s.state == "ready", 120, "ready", since)

        def shapes() -> dict[str, dict[str, tuple[str, bool]]]:
            found = {host: _shape(control, host, f"d-{host}") for host in (REAL, STAND_IN)}
            for left_out in LEFT_OUT:
                found[REAL].pop(left_out, None)
            return found

        # Each host's load comes within its next second of serving.
        poll(lambda: (found := shapes())[STAND_IN] == found[REAL], 10)
        found = shapes()
        assert found[STAND_IN] == found[REAL]
        records = {host: _record(control, host, f"d-{host}") for host in (REAL, STAND_IN)}
        filled = {
            host: {name for name, value in record.model_dump().items() if value not in (None, ())}
            for host, record in records.items()
        }
        assert filled[STAND_IN] == filled[REAL] - {"log_path"}
        with Management(StatePaths(server.state_dir)) as api:
            for host in (REAL, STAND_IN):
                since = time.time()
                api.act(f"d-{host}", "stop")
                wait_until(api, f"d-{host}", lambda s: s.state == "stopped", 60, "stopped", since)
        events = {host: _events(control, host) for host in (REAL, STAND_IN)}
        assert events[STAND_IN] == events[REAL]
        wait_for(lambda: notes.kinds(STAND_IN) >= notes.kinds(REAL), 10, "every notification kind")
        assert notes.kinds(STAND_IN) == notes.kinds(REAL)
    finally:
        stop.set()
        if stand_in.is_alive():
            stand_in.join(timeout=30)
        notes.close()
        control.close()
        if real is not None:
            real.stop()
        server.stop()
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)
