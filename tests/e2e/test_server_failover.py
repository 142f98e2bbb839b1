"""Three servers that lose one, as it will fail: servers on 127.0.0.11-13 (each its Redis,
Sentinel, scheduler and router), two joined hosts on 127.0.0.21-22. Under steady load through
the openai SDK, every process of the primary server is killed at once; requests through the
surviving routers recover within the bound, no declared deployment is lost, no engine is
duplicated or left without its record, no place leaks, and a new scheduler leads. A leader
frozen and resumed sends nothing under its old epoch, and a command stamped with it is
refused. The lost server, started again, rejoins as a replica with no manual step.

The tests run in order on one fleet: each leaves the next its setting.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

import openai
import pytest
import redis
import redis.asyncio as aioredis

from capycommon.domain.commands import Stop
from capycommon.domain.instances import LIVE_STATES, InstanceRecord
from capycommon.domain.places import Places
from capycommon.state import hostcommands, keys
from capycommon.state.stores import Blocking
from capyctl_cli.gpucheck.role import end_left_under
from cluster import SMALL, GiB
from enginerun import sparse_model
from enginesim.behaviour import Behaviour
from enginesim.install import install_python_engine
from ports import free_port, reserved_everywhere
from serversetup import ask
from support import (
    Role,
    clean_env,
    join_with_engines,
    live_processes,
    poll,
    short_dir,
    start_host,
    start_role,
    wait_for,
)

SERVERS = {"s1": "127.0.0.11", "s2": "127.0.0.12", "s3": "127.0.0.13"}
HOSTS = {"gpu-a": "127.0.0.21", "gpu-b": "127.0.0.22"}
MODELS = ("m1", "m2")
# What the note states: a surviving router answers again within this many seconds of the
# primary's loss (Sentinel's 2 s to call it down, its election, and the scheduler lease).
RECOVERY_BOUND_S = 15.0


@dataclass
class Load:
    """Requests sent one after another by a thread per surviving router, alternating the
    models; each outcome kept with when it ended."""

    clients: list[openai.OpenAI]
    outcomes: list[tuple[float, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for client in self.clients:
            thread = threading.Thread(target=self._run, args=(client,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _run(self, client: openai.OpenAI) -> None:
        turn = 0
        while not self.stop.is_set():
            model = MODELS[turn % len(MODELS)]
            turn += 1
            try:
                ask(client, model)
                outcome = "ok"
            except openai.APIStatusError as exc:
                outcome = str(exc.status_code)
            except openai.APIConnectionError:
                outcome = "connection"
            self.outcomes.append((time.monotonic(), outcome))

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=60)

    def first_success_after(self, moment: float) -> float | None:
        found = [at for at, outcome in self.outcomes if at > moment and outcome == "ok"]
        return min(found) - moment if found else None

    def successes_after(self, moment: float) -> int:
        return sum(1 for at, outcome in self.outcomes if at > moment and outcome == "ok")

    def longest_gap_after(self, moment: float) -> float:
        """The longest time from `moment` on without a request succeeding."""
        ends = [moment, *sorted(at for at, o in self.outcomes if at > moment and o == "ok")]
        return max(later - earlier for earlier, later in pairwise(ends))


@dataclass
class Fleet:
    folder: Path
    tls_port: int
    sentinel_port: int
    peer_file: Path
    servers: dict[str, Role] = field(default_factory=dict)
    flags: dict[str, tuple[str, ...]] = field(default_factory=dict)
    listeners: dict[str, tuple[str, str]] = field(default_factory=dict)
    hosts: dict[str, Role] = field(default_factory=dict)
    clients: list[openai.OpenAI] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def start_server(self, name: str, peer: bool) -> Role:
        ip = SERVERS[name]
        if name not in self.flags:
            others = ",".join(address for other, address in SERVERS.items() if other != name)
            self.flags[name] = (
                "--enrollment-control-bind", f"{ip}:{self.tls_port}",
                "--enrollment-bootstrap-bind", f"{ip}:{free_port(ip)}",
                "--replication-advertise", ip,
                "--replication-peers", others,
                "--replication-sentinel-port", str(self.sentinel_port),
                "--server-scheduling-host-lost-after", "6",
            )  # fmt: skip
            self.listeners[name] = (f"{ip}:{free_port(ip)}", f"{ip}:{free_port(ip)}")
        extra = (*self.flags[name], *(("--peer-file", str(self.peer_file)) if peer else ()))
        home = self.folder / name
        home.mkdir(exist_ok=True)
        role = start_role(
            "server",
            state_dir=home / "state",
            extra=extra,
            env=clean_env(HOME=str(home)),
            listeners=self.listeners[name],
        )
        self.servers[name] = role
        return role

    def openai(self, name: str) -> openai.OpenAI:
        server = self.servers[name]
        key = server.credentials()["api_key"]
        client = openai.OpenAI(
            base_url=f"http://{server.inference}/v1", api_key=key, timeout=20, max_retries=0
        )
        self.clients.append(client)
        return client

    def primary(self) -> str | None:
        """The server whose Redis is the primary now, as its own Redis says."""
        for name, server in self.servers.items():
            try:
                with server.control() as client:
                    role = cast(list[Any], client.execute_command("ROLE"))
            except (redis.RedisError, OSError):
                continue
            if role[0] == b"master":
                return name
        return None

    def control(self) -> redis.Redis:
        """The primary's Redis, as the control plane's user."""
        name = wait_for(self.primary, timeout=30, what="a primary")
        return self.servers[name].control()

    def lease(self) -> dict[str, Any] | None:
        """The scheduler lease, as a surviving server's own Redis holds it (a replica's copy
        is a moment behind at most)."""
        for server in self.servers.values():
            if server.proc.poll() is not None:
                continue
            try:
                with server.control(socket_timeout=1) as client:
                    raw = client.get(keys.scheduler_lease())
            except (redis.RedisError, OSError):
                continue
            found: dict[str, Any] | None = None if raw is None else json.loads(cast(bytes, raw))
            return found
        return None

    def instances(self, name: str) -> list[InstanceRecord]:
        with self.control() as client:
            found = []
            for host in HOSTS:
                raw = cast(bytes | None, client.get(keys.instance(host, name, 0)))
                if raw is not None:
                    found.append(InstanceRecord.model_validate_json(raw))
        return found

    def places(self, name: str) -> Places:
        """The deployment's places over every router worker, the lost server's included."""
        server = self.servers[wait_for(self.primary, timeout=30, what="a primary")]
        password = (server.state_dir / "identity" / "redis-password").read_text().strip()
        client = aioredis.Redis(
            unix_socket_path=str(server.state_dir / "redis" / "redis.sock"),
            username="capyctl",
            password=password,
        )
        with Blocking(client) as state:
            return state(lambda s: s.places.get(name))

    def live(self, name: str) -> list[InstanceRecord]:
        return [record for record in self.instances(name) if record.state in LIVE_STATES]


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    folder = short_dir("fleet")
    tls = reserved_everywhere(tuple(SERVERS.values()))
    sentinel = reserved_everywhere(tuple(SERVERS.values()))
    found = Fleet(folder, tls[0].getsockname()[1], sentinel[0].getsockname()[1], folder / "s.peer")
    fast = Behaviour(load_seconds=0.3, tokens_per_second=200)
    installs = {"vllm": install_python_engine(folder / "e" / "vllm", "vllm", "0.29.0", fast)}
    try:
        first = found.start_server("s1", peer=False)
        # With the settings the role runs with (flags here, as the role was given them).
        invited = first.capyctl(
            "invite", "server", "--output", str(found.peer_file), *found.flags["s1"]
        )
        assert invited.returncode == 0, invited.stderr
        # The two others start side by side, as their machines would.
        with ThreadPoolExecutor(2) as starting:
            started = [starting.submit(found.start_server, name, True) for name in ("s2", "s3")]
            for each in started:
                each.result()
        for index, (name, address) in enumerate(HOSTS.items()):
            home = folder / name
            join_with_engines(first, name, home, installs)
            for model in MODELS:
                sparse_model(home / "models" / model, 2 * GiB)
            found.hosts[name] = start_host(
                home / "state",
                engine_range=index + 1,
                env={
                    "HOME": str(home),
                    "CAPYCTL_HOST_INGRESS_BIND": f"{address}:{free_port(address)}",
                },
            )
        yield found
    finally:
        for client in found.clients:
            client.close()
        for role in [*found.hosts.values(), *found.servers.values()]:
            role.stop()
        end_left_under(folder)
        for held in (*tls, *sentinel):
            held.close()
        shutil.rmtree(folder, ignore_errors=True)


def test_three_servers_share_one_state(fleet: Fleet) -> None:
    assert fleet.primary() == "s1"
    first = fleet.servers["s1"]
    for model in MODELS:
        path = fleet.folder / f"{model}.yaml"
        document = {"name": model, "engine": "vllm", "model": model, "engine_config": SMALL}
        path.write_text(json.dumps(document))
        deployed = first.capyctl("deploy", "model", "--file", str(path))
        assert deployed.returncode == 0, deployed.stderr
    # Each router serves every model, wherever its request lands.
    for name in SERVERS:
        for model in MODELS:
            assert ask(fleet.openai(name), model), f"{model} through {name}"
    status = fleet.servers["s2"].status()
    assert status["scheduler_lease"] is not None
    replication = status["replication"]
    assert replication["primary"].startswith(SERVERS["s1"]), replication
    assert replication["quorum"] is True, replication


def test_the_loss_of_the_primary_server_is_ridden_out(fleet: Fleet) -> None:
    before = fleet.lease()
    assert before is not None
    load = Load([fleet.openai("s2"), fleet.openai("s2"), fleet.openai("s3"), fleet.openai("s3")])
    load.start()
    try:
        wait_for(lambda: len(load.outcomes) >= 20, timeout=60, what="steady load")
        killed_at = kill_server(fleet.servers["s1"])
        del fleet.servers["s1"]
        primary = wait_for(fleet.primary, timeout=30, what="a new primary")
        fleet.figures["new_primary_s"] = round(time.monotonic() - killed_at, 1)
        new_lease = wait_for(
            lambda: (lease := fleet.lease()) and lease["epoch"] > before["epoch"] and lease,
            timeout=30,
            what="a new scheduler to take the lease",
        )
        fleet.figures["new_leader_s"] = round(time.monotonic() - killed_at, 1)
        recovered = wait_for(
            lambda: load.first_success_after(killed_at),
            timeout=RECOVERY_BOUND_S + 30,
            what="a request to succeed after the kill",
        )
        wait_for(
            lambda: load.successes_after(killed_at + recovered) >= 40,
            timeout=60,
            what="the load to go on through the surviving routers",
        )
    finally:
        load.end()
    outcomes = Counter(outcome for _, outcome in load.outcomes)
    replicas = fleet.servers[primary].status()["replication"]["replicas"]
    fleet.figures.update(
        sent=len(load.outcomes),
        succeeded=outcomes["ok"],
        failed={k: v for k, v in outcomes.items() if k != "ok"},
        first_success_s=round(recovered, 2),
        longest_gap_s=round(load.longest_gap_after(killed_at), 2),
        primary=primary,
        leader=new_lease["server"],
        replica_lag=[(r["address"], r["behind_bytes"], r["lag_s"]) for r in replicas],
    )
    print("failover figures:", json.dumps(fleet.figures))
    assert recovered <= RECOVERY_BOUND_S, fleet.figures
    assert load.longest_gap_after(killed_at) <= RECOVERY_BOUND_S, fleet.figures
    with fleet.control() as client:
        declared = {m.decode() for m in cast(set[bytes], client.smembers(keys.deployments()))}
    assert declared == set(MODELS), "no declared deployment is lost"


def kill_server(server: Role) -> float:
    """SIGKILL every process of the server at once: its launcher, supervisord, Redis,
    Sentinel, scheduler, router and the router's workers. When it was done (monotonic)."""
    report = server.status()
    pids = [server.proc.pid]
    for process in report["processes"]:
        pids += [process["pid"], *(worker["pid"] for worker in process["workers"])]
    supervisord = (server.state_dir / "run" / "supervisord.pid").read_text().strip()
    pids.append(int(supervisord))
    for pid in pids:
        if pid:
            os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    server.proc.wait(timeout=10)
    return killed_at


def test_no_engine_is_duplicated_or_orphaned_and_no_place_leaks(fleet: Fleet) -> None:
    for model in MODELS:
        live = wait_for(
            partial(_one_live, fleet, model),
            timeout=30,
            what=f"one live engine of {model}",
        )
        assert live
        # Each engine of the model runs under a record: one engine, the record's own.
        assert _engine_groups(fleet, model) == {
            record.process.pgid for record in live if record.process
        }

    def settled() -> bool:
        return all(fleet.places(model).running == 0 for model in MODELS)

    wait_for(settled, timeout=40, what="every place given back, the lost router's included")


def _one_live(fleet: Fleet, model: str) -> list[InstanceRecord] | None:
    live = fleet.live(model)
    return live if len(live) == 1 else None


def _engine_groups(fleet: Fleet, model: str) -> set[int]:
    """The process groups of the engines serving `model` on either host: those of the
    processes started on its weights."""
    paths = [str(fleet.folder / host / "models" / model) for host in HOSTS]
    return {p.pgid for p in live_processes() if any(path in p.cmdline for path in paths)}


def test_a_frozen_leader_sends_nothing_under_its_old_epoch(fleet: Fleet) -> None:
    lease = wait_for(fleet.lease, timeout=20, what="a leader")
    leader = next(n for n, s in fleet.servers.items() if lease["server"].endswith(str(s.state_dir)))
    other = next(name for name in fleet.servers if name != leader)
    scheduler = fleet.servers[leader].processes()["scheduler"]["pid"]
    frozen_at = f"{int(time.time() * 1000)}-0"
    os.kill(scheduler, signal.SIGSTOP)
    try:
        taken = wait_for(
            lambda: (now := fleet.lease()) and now["epoch"] > lease["epoch"] and now,
            timeout=20,
            what="another scheduler to take the lease",
        )
        assert taken["server"] != lease["server"]
        # Work for the new leader while the old one is frozen: a stop, then a start.
        stopped = fleet.servers[other].capyctl("stop", "deployment", MODELS[1], "--wait")
        assert stopped.returncode == 0, stopped.stderr
    finally:
        os.kill(scheduler, signal.SIGCONT)
    started = fleet.servers[other].capyctl("start", "deployment", MODELS[1], "--wait")
    assert started.returncode == 0, started.stderr
    assert ask(fleet.openai(other), MODELS[1]), "started again by the new leader"
    with fleet.control() as client:
        # The resumed scheduler, its lease gone, sends nothing: every command since the
        # freeze carries the new epoch.
        assert _epochs_sent(client, frozen_at) == {taken["epoch"]}
        assert poll(lambda: _epochs_sent(client, frozen_at) - {taken["epoch"]}, timeout=3) is None
        # A command stamped with the old epoch, as the deposed leader would send it, is refused.
        live = fleet.live(MODELS[0])[0]
        stop = Stop(deployment=MODELS[0], generation=live.generation)
        client.xadd(keys.host_commands(live.host), hostcommands.fields_of(stop, lease["epoch"]))

        def fenced() -> bool:
            entries = cast(
                list[tuple[bytes, dict[bytes, bytes]]], client.xrange(keys.host_events(live.host))
            )
            return any(json.loads(f[b"event"])["kind"] == "fenced" for _, f in entries)

        wait_for(fenced, timeout=20, what="the stamped stop to be refused")
    assert fleet.live(MODELS[0]), "the model still serves"


def _epochs_sent(client: redis.Redis, since: str) -> set[int]:
    """The epochs of the instance commands sent to any host since `since` (a stream id)."""
    found = set()
    for host in HOSTS:
        entries = cast(
            list[tuple[bytes, dict[bytes, bytes]]], client.xrange(keys.host_commands(host), since)
        )
        for _, fields in entries:
            epoch = hostcommands.epoch_of(fields)
            if epoch is not None:
                found.add(epoch)
    return found


def test_the_lost_server_rejoins_as_a_replica(fleet: Fleet) -> None:
    back = fleet.start_server("s1", peer=False)

    def following() -> bool:
        with back.control() as client:
            role = cast(list[Any], client.execute_command("ROLE"))
        return bool(role[0] == b"slave" and role[3] == b"connected")

    wait_for(following, timeout=60, what="s1's Redis to replicate the new primary")
    status = back.status()
    assert not status["scheduler_lease"]["here"]
    assert not status["replication"]["primary"].startswith(SERVERS["s1"])
    for model in MODELS:
        assert ask(fleet.openai("s1"), model), f"{model} through the server that came back"
