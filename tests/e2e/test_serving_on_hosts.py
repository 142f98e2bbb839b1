"""A server serves models on its joined hosts: two hosts on their own loopback addresses, each
with a 24 GiB simulated GPU, serve three 14 GiB models through one OpenAI endpoint (each
host's ingress over mutual TLS), cancel across the network, ride out their agents' kill -9,
lose a host (its model moves), and are revoked while serving, with no request left hanging.

The tests run in order on one server and its hosts: each leaves the next its setting.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import httpx
import openai
import pytest

from capycommon.domain.hosts import HOST_CAPABILITIES, STARTUP_HOST_BYTES, HostInfo
from capycommon.domain.instances import LIVE_STATES, InstanceRecord
from capycommon.paths import StatePaths
from capycommon.state import keys
from capyctl_cli.gpucheck.role import end_left_under
from capyctl_cli.management import Management
from cluster import FOURTEEN, SMALL, GiB
from enginerun import sparse_model
from enginesim.behaviour import Behaviour, DisconnectLag, Faults
from enginesim.install import install_python_engine
from hostilehost import redis_as_host
from ports import free_port
from serversetup import ServerSetup, ask
from support import (
    Role,
    cancel,
    clean_env,
    held_chat,
    join_with_engines,
    short_dir,
    start_host,
    start_role,
    wait_for,
    wait_for_async,
)

# A host unreachable this long is gone: its models start elsewhere.
LOST_AFTER_S = 6
HOSTS = {"gpu-a": "127.0.0.2", "gpu-b": "127.0.0.3"}
HI: list[Any] = [{"role": "user", "content": "hi"}]


@dataclass
class Setup(ServerSetup):
    # The server's flags, kept for its restart: the same enrollment ports.
    flags: tuple[str, ...]
    hosts: dict[str, Role] = field(default_factory=dict)
    ingress: dict[str, str] = field(default_factory=dict)

    def instances(self, name: str) -> dict[str, InstanceRecord]:
        """The deployment's instance on each host that has one."""
        found = {}
        for host in HOSTS:
            raw = cast(bytes | None, self.redis.get(keys.instance(host, name, 0)))
            if raw is not None:
                found[host] = InstanceRecord.model_validate_json(raw)
        return found

    def where(self, name: str) -> str | None:
        """The host of the deployment's live instance of the highest generation."""
        live = [i for i in self.instances(name).values() if i.state in LIVE_STATES]
        return max(live, key=lambda i: i.generation).host if live else None

    def engine(self, name: str, host: str) -> tuple[str, str]:
        """The engine's own URL and key on its host (all of them run on this machine)."""
        instance = self.instances(name)[host]
        secret = cast(bytes, self.redis.get(keys.instance_secret(host, name, 0))).decode()
        return f"http://127.0.0.1:{instance.port}", secret

    def start_host(self, name: str) -> Role:
        home = self.folder / name
        role = start_host(
            home / "state",
            engine_range=1 if name == "gpu-a" else 2,
            env={"HOME": str(home), "CAPYCTL_HOST_INGRESS_BIND": self.ingress[name]},
        )
        self.hosts[name] = role
        return role


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    folder = short_dir("hosts")
    flags = (
        "--server-scheduling-host-lost-after",
        str(LOST_AFTER_S),
        "--enrollment-control-bind",
        f"127.0.0.1:{free_port()}",
        "--enrollment-bootstrap-bind",
        f"127.0.0.1:{free_port()}",
    )
    server = start_role("server", extra=flags, env=clean_env(HOME=str(folder)))
    found = Setup(folder, server, flags)
    fast = Behaviour(load_seconds=0.5, tokens_per_second=200)
    slow = Behaviour(load_seconds=0.5, tokens_per_second=8, answer=" ".join(["word"] * 200))
    # SGLang 0.5.22 tells hostd when it ends a request (its place settles then); a prefill
    # holds each request a moment before its first token. Its own abort of a hung-up request
    # comes late here, so a request that ends at once was aborted by its id.
    ends = Behaviour(
        load_seconds=0.5,
        tokens_per_second=8,
        prefill_seconds=1.5,
        answer=" ".join(["w"] * 400),
        faults=Faults(disconnect_abort_lag=DisconnectLag(non_stream=60, stream=60)),
    )
    installs = {
        "vllm": install_python_engine(folder / "e" / "vllm", "vllm", "0.29.0", fast),
        "slowsglang": install_python_engine(folder / "e" / "slow", "sglang", "0.5.16", slow),
        "sg22": install_python_engine(folder / "e" / "sg22", "sglang", "0.5.22", ends),
    }
    try:
        for name, address in HOSTS.items():
            home = folder / name
            join_with_engines(server, name, home, installs)
            sparse_model(home / "models" / "m14", 10 * GiB)
            sparse_model(home / "models" / "small", 2 * GiB)
            found.ingress[name] = f"{address}:{free_port()}"
            found.start_host(name)
        sparse_model(folder / "gpu-b" / "models" / "only-b", 2 * GiB)
        yield found
    finally:
        found.close_clients()
        for role in found.hosts.values():
            role.stop()
        found.server.stop()  # the one running now (a test restarts it)
        end_left_under(folder)  # engines outlive their roles by design: the test's own end here
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(server.state_dir.parent, ignore_errors=True)


def test_three_models_that_fit_only_across_both_hosts_are_served_in_turn(setup: Setup) -> None:
    hosts = json.loads(setup.ok("list", "hosts", "--json"))
    assert {row["name"]: row["joined"] for row in hosts} == {"gpu-a": True, "gpu-b": True}
    for name in ("m1", "m2", "m3"):
        setup.deploy(name, engine_config=FOURTEEN)
    client = setup.openai()
    for name in ("m1", "m2", "m3", "m1", "m2", "m3"):
        assert ask(client, name), f"{name} answered nothing"
        assert ask(client, name, stream=True), f"{name} streamed nothing"
    # Two 14 GiB models per 24 GiB GPU never fit: each host served, and switched.
    served = {event["host"] for event in _choices(setup) if event["kind"] == "start"}
    assert served == {"gpu-a", "gpu-b"}
    raw = client.chat.completions.with_raw_response.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert raw.headers.get("x-capyctl-request-id")


def test_a_model_a_host_lacks_is_not_placed_there_and_status_says_why(setup: Setup) -> None:
    setup.deploy("b-only", model="only-b", engine_config=SMALL)
    assert ask(setup.openai(), "b-only")
    assert setup.where("b-only") == "gpu-b"
    status = json.loads(setup.ok("status", "deployment", "b-only", "--json"))
    text = json.dumps(status)
    assert "gpu-a" in text, text
    assert "only-b" in text, text


def test_placement_hosts_pins_a_model(setup: Setup) -> None:
    setup.deploy("pinned", model="small", engine_config=SMALL, placement={"hosts": ["gpu-a"]})
    assert ask(setup.openai(), "pinned")
    assert setup.where("pinned") == "gpu-a"


def test_a_host_that_claims_an_earlier_release_is_not_given_a_model_measured_there(
    setup: Setup,
) -> None:
    def measured() -> bool:
        status = json.loads(setup.ok("status", "deployment", "pinned", "--json"))
        return bool(status["startup"] and status["startup"]["host_provenance"] == "measured")

    wait_for(measured, timeout=60, what="gpu-a's memwatch to measure the start of 'pinned'")
    setup.ok("stop", "deployment", "pinned", "--wait")
    key = keys.host_info("gpu-a")
    with redis_as_host(setup.hosts["gpu-a"].state_dir) as host:
        info = HostInfo.model_validate_json(cast(bytes, host.get(key)))
        assert STARTUP_HOST_BYTES in info.capabilities
        # What a host of 0.1.6 says of itself, written with the host's own credentials.
        older = info.model_copy(update={"version": "0.1.6", "capabilities": ()})
        host.set(key, older.model_dump_json())
        try:
            refused = setup.server.capyctl("start", "deployment", "pinned", "--wait")
            rows = {row["name"]: row for row in json.loads(setup.ok("list", "hosts", "--json"))}
        finally:
            host.set(key, info.model_dump_json())
    assert refused.returncode == 5, refused.stderr
    assert "host_capability_missing:startup_host_bytes" in refused.stderr
    assert "host gpu-a, which runs CapyCTL 0.1.6" in refused.stderr
    assert rows["gpu-a"]["capabilities"] == []
    assert rows["gpu-b"]["capabilities"] == list(HOST_CAPABILITIES)
    setup.ok("start", "deployment", "pinned", "--wait")  # its own word again: it starts there
    assert setup.where("pinned") == "gpu-a"


def test_a_hang_up_through_the_ingress_stops_the_engines_work_within_a_second(
    setup: Setup,
) -> None:
    setup.deploy("slow", engine="slowsglang", model="small", engine_config=SMALL)
    assert ask(setup.openai(), "slow")
    host = setup.where("slow")
    assert host is not None
    url, secret = setup.engine("slow", host)
    key = setup.server.credentials()["api_key"]
    body = {"model": "slow", "messages": [{"role": "user", "content": "go"}], "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream(
            "POST",
            f"http://{setup.server.inference}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        ) as answer,
    ):
        assert answer.status_code == 200
        chunks = answer.iter_raw()  # held: a dropped iterator closes the response
        next(chunks)  # the engine is answering
        wait_for(lambda: _running(url, secret) == 1, timeout=10, what="the engine to count it")
        hung_up = time.monotonic()
    wait_for(lambda: _running(url, secret) == 0, timeout=1.0, what="the engine to stop")
    assert time.monotonic() - hung_up < 1.5


def test_on_a_joined_host_a_cut_request_is_aborted_by_its_id_and_settles_when_it_ends(
    setup: Setup,
) -> None:
    """Through a host's ingress, SGLang 0.5.22: a request cut streamed after its first token,
    or not streamed before any answer, is aborted by its id, and its place settles once the
    host reports that the engine ended it, while another request keeps the engine busy (so
    it never reads idle)."""
    setup.deploy("sg22", engine="sg22", model="small", engine_config=SMALL)
    # Started without a request: a request's place kept as a router's spare would carry the
    # next one uncounted.
    setup.ok("start", "deployment", "sg22", "--wait")
    host = setup.where("sg22")
    assert host is not None
    url, secret = setup.engine("sg22", host)
    key = setup.server.credentials()["api_key"]
    base = f"http://{setup.server.inference}/v1"

    def places() -> tuple[int, int, int]:
        with Management(StatePaths(setup.server.state_dir)) as api:
            found = api.status("sg22").requests
        return found.running, found.settle_when_idle, found.settle_at_stop

    async def scenario() -> None:
        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Bearer {key}"}, timeout=60
        ) as http:

            def send(
                stream: bool, max_tokens: int, first: asyncio.Event | None = None
            ) -> Coroutine[Any, Any, None]:
                body = {"model": "sg22", "messages": HI, "stream": stream, "max_tokens": max_tokens}
                return held_chat(http, body, first)

            async def engine_runs(count: int) -> None:
                async def runs() -> bool:
                    return await asyncio.to_thread(_running, url, secret) == count

                await wait_for_async(runs, timeout=15, what=f"the engine to run {count}")

            busy = asyncio.create_task(send(True, 400))
            await engine_runs(1)
            for stream in (True, False):
                aborted = await asyncio.to_thread(_aborted, url, secret)
                first = asyncio.Event() if stream else None
                cut = asyncio.create_task(send(stream, 200, first))
                await engine_runs(2)
                if first is not None:
                    await asyncio.wait_for(first.wait(), 10)
                await cancel(cut)
                await engine_runs(1)  # long before SGLang would abort it itself
                # hostd aborts by id until an abort counts nothing: once, or more.
                assert await asyncio.to_thread(_aborted, url, secret) > aborted, "by its id"

                async def settled() -> bool:
                    return await asyncio.to_thread(places) == (1, 0, 0)

                try:
                    await wait_for_async(settled, timeout=10, what="the cut request's place")
                except AssertionError:
                    raise AssertionError(f"stream={stream}: {places()}") from None
                assert not busy.done(), "the engine never read idle: the host reported the end"
            await cancel(busy)

    asyncio.run(scenario())


def test_killing_a_hosts_agents_loses_nothing_and_its_engines_are_re_adopted(
    setup: Setup,
) -> None:
    client = setup.openai()
    assert ask(client, "pinned")
    before = setup.instances("pinned")["gpu-a"]
    role = setup.hosts["gpu-a"]
    agents = role.processes()
    for name in ("hostd", "memwatch"):
        os.kill(agents[name]["pid"], signal.SIGKILL)
    wait_for(
        lambda: (
            role.healthy()
            and all(role.processes()[n]["pid"] != agents[n]["pid"] for n in ("hostd", "memwatch"))
        ),
        timeout=30,
        what="supervisord to restart the host's agents",
    )
    wait_for(
        lambda: setup.instances("pinned")["gpu-a"].state == "ready",
        timeout=30,
        what="the engine re-adopted",
    )
    after = setup.instances("pinned")["gpu-a"]
    assert (after.generation, after.process) == (before.generation, before.process)
    assert ask(client, "pinned")


def test_a_drained_host_takes_no_new_model_until_undrained(setup: Setup) -> None:
    client = setup.openai()
    assert "takes no new model" in setup.ok("drain", "host", "gpu-a")
    rows = {row["name"]: row for row in json.loads(setup.ok("list", "hosts", "--json"))}
    assert (rows["gpu-a"]["drained"], rows["gpu-b"]["drained"]) == (True, False)

    def stopped_there() -> bool:
        found = [setup.instances(name).get("gpu-a") for name in ("pinned", "m1", "m3")]
        return all(i.state not in LIVE_STATES for i in found if i is not None)

    wait_for(stopped_there, timeout=60, what="the drained host's engines to stop")
    # A model that may run only there is refused at once; one that may run elsewhere moves.
    with pytest.raises(openai.APIStatusError) as refused:
        ask(client, "pinned")
    assert refused.value.status_code == 503
    assert "host_drained" in str(refused.value.body)
    assert ask(client, "m1")
    assert setup.where("m1") == "gpu-b"
    assert "takes models again" in setup.ok("undrain", "host", "gpu-a")
    assert ask(client, "pinned")
    assert setup.where("pinned") == "gpu-a"


def test_a_server_restart_loses_nothing_and_its_hosts_engines_serve_on(setup: Setup) -> None:
    client = setup.openai()
    assert ask(client, "pinned")
    before = setup.instances("pinned")["gpu-a"]
    old = setup.server
    assert old.stop() == 0
    setup.server = start_role(
        "server",
        state_dir=old.state_dir,
        extra=setup.flags,
        env=old.env,
        listeners=(old.inference, old.management),
    )
    for role in setup.hosts.values():
        wait_for(role.healthy, timeout=60, what="the hosts' agents to beat in the new server")
    assert ask(setup.openai(), "pinned")
    after = setup.instances("pinned")["gpu-a"]
    assert (after.generation, after.process) == (before.generation, before.process)
    names = {row["name"] for row in json.loads(setup.ok("list", "deployments", "--json"))}
    assert {"m1", "m2", "m3", "b-only", "pinned", "slow"} <= names


def test_a_host_that_stops_loses_its_models_to_the_other_host(setup: Setup) -> None:
    client = setup.openai(timeout=90)
    assert ask(client, "m2")
    lost = setup.where("m2")
    assert lost is not None
    kept = next(host for host in HOSTS if host != lost)
    setup.hosts[lost].stop()
    started = time.monotonic()
    assert ask(client, "m2"), "m2 answered once it moved"
    assert setup.where("m2") == kept
    # Unreachable within its heartbeat's lifetime (10 s), gone after LOST_AFTER_S more.
    assert time.monotonic() - started < 10 + LOST_AFTER_S + 30
    marks = cast(dict[bytes, bytes], setup.redis.hgetall(keys.unreachable_hosts()))
    assert lost.encode() in marks
    # A model that may run only there is refused at once, not left waiting.
    if lost == "gpu-b":
        refused_at = time.monotonic()
        with pytest.raises(openai.APIStatusError) as refused:
            ask(client, "b-only")
        assert refused.value.status_code == 503
        assert "host_unreachable" in str(refused.value.body)
        assert time.monotonic() - refused_at < 5
    # Back again: its old engine of m2 is stopped, so m2 runs once.
    setup.start_host(lost)
    wait_for(
        lambda: setup.instances("m2")[lost].state not in LIVE_STATES,
        timeout=60,
        what="the returning host's duplicate of m2 to stop",
    )
    wait_for(
        lambda: lost.encode() not in setup.redis.hgetall(keys.unreachable_hosts()),
        timeout=10,
        what="the host marked reachable again",
    )
    assert ask(client, "m2")
    live = [i for i in setup.instances("m2").values() if i.state in LIVE_STATES]
    assert len(live) == 1


def test_revoking_a_host_while_it_serves_ends_its_requests_and_none_hangs(setup: Setup) -> None:
    client = setup.openai(timeout=30)
    assert ask(client, "slow")
    host = setup.where("slow")
    assert host is not None
    outcome: dict[str, object] = {}

    def stream() -> None:
        try:
            outcome["answer"] = ask(setup.openai(timeout=30), "slow", stream=True)
        except openai.APIError as exc:
            outcome["error"] = exc

    reader = threading.Thread(target=stream)
    reader.start()
    url, secret = setup.engine("slow", host)
    wait_for(lambda: _running(url, secret) == 1, timeout=10, what="the stream under way")
    setup.ok("revoke", "host", host)
    reader.join(timeout=20)
    assert not reader.is_alive(), "a request through the revoked host hung"
    assert outcome, "the request ended with neither an answer nor an error"
    # The host role stops with host_revoked (14); the router sends it nothing more.
    assert setup.hosts[host].proc.wait(timeout=30) == 14
    wait_for(
        lambda: host.encode() in setup.redis.hgetall(keys.unreachable_hosts()),
        timeout=5,
        what="the revoked host marked unreachable",
    )


def _running(url: str, secret: str) -> int:
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {secret}"}).text
    for line in text.splitlines():
        if line.startswith("sglang:num_running_reqs"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("the engine reports no running requests")


def _aborted(url: str, secret: str) -> int:
    """The requests SGLang aborted by their id, as its metrics count them."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {secret}"}).text
    found = re.search(r"^sglang:num_aborted_requests(?:_total)?\{[^}]*\} (\S+)$", text, re.M)
    return int(float(found[1])) if found else 0


def _choices(setup: Setup) -> list[dict[str, Any]]:
    entries = cast(list[tuple[bytes, dict[bytes, bytes]]], setup.redis.xrange(keys.events()))
    return [json.loads(fields[b"event"]) for _, fields in entries]
