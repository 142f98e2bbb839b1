"""The host's ingress, over real TLS, in front of a real simulated vLLM: with certificates of
a real authority (a host's, which it presents, and a router's), a real Redis holding the
instance's record, and the ingress served as hostd serves it (in a thread of its own here).

Only the router's certificate gets a request through, and the answer is the engine's own,
streamed or not; a host's certificate, or none, gets nothing. A request for another
generation, or for an instance that stopped serving, is refused with 409 stale_dispatch; a
path that is not an inference path never reaches the engine; a router that hangs up in the
middle of a stream ends the engine's request at once.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest

from capycommon import ingress, pki
from capycommon.authority import Authority
from capycommon.domain.engines import Residency
from capycommon.domain.hosts import HOST_CAPABILITIES, HostInfo
from capycommon.domain.instances import InstanceState
from capycommon.paths import StatePaths, ensure_private_dir, write_atomic
from capycommon.service import redis_client
from capycommon.state import keys
from capycommon.state.stores import State
from capycommon.version import __version__
from capyctl_hostd.engines import Engine
from capyctl_hostd.ingress import HostIngress
from capyctl_hostd.serving import Serving
from enginerun import KEY, RunningEngine, launch, make_devices
from enginesim.install import install_python_engine
from integration.hostd.harness import FAST, Hostd
from integration.hostd.harness import HOST as HARNESS_HOST
from ports import free_port
from support import instance_record, short_dir, wait_for

HOST = "gpu-1"
HOST_ID = "01J9ZQ4Y5W6X7A8B9C0D1E2F3G"
DEPLOYMENT = "tiny"
GENERATION = 3
LIFETIME = timedelta(hours=1)
ANSWER = " ".join(f"token{index}" for index in range(3000))
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say hello to the ingress"}]}


@dataclass(frozen=True)
class Identity:
    """A certificate and its key, each in a file (as a TLS client loads them)."""

    cert: Path
    key: Path

    def context(self, authority: Path) -> ssl.SSLContext:
        """A client's TLS context presenting this identity, checking the ingress's
        certificate against `authority` but not its name, as the router does."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.load_verify_locations(cafile=authority)
        context.check_hostname = False
        context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True)
class Pki:
    authority: Authority
    ca: Path
    host: Identity
    router: Identity
    state: StatePaths


def issue(authority: Authority, folder: Path, kind: pki.Kind, name: str, stem: str) -> Identity:
    """A certificate of `kind` from `authority`, in `stem`.crt and its key in `stem`.key."""
    key = pki.new_private_key()
    request = pki.certificate_request(key, name)
    cert = authority.sign_request(
        request, kind=kind, name=name, identity=HOST_ID, lifetime=LIFETIME
    )
    identity = Identity(folder / f"{stem}.crt", folder / f"{stem}.key")
    write_atomic(identity.cert, cert.decode())
    write_atomic(identity.key, key.decode())
    return identity


@pytest.fixture(scope="module")
def certificates() -> Iterator[Pki]:
    """An authority, a host's identity files as a joined host keeps them, and a router's."""
    folder = short_dir("ingress")
    authority = Authority.create(folder / "ca", "capyctl test authority")
    state = StatePaths(folder / "host")
    ensure_private_dir(state.identity_dir)
    host = issue(authority, folder, "host", HOST, "host")
    router = issue(authority, folder, "router", "router", "router")
    write_atomic(state.host_certificate, host.cert.read_text() + host.key.read_text())
    write_atomic(state.joined_authority, authority.certificate_pem.decode())
    yield Pki(authority, folder / "ca" / "ca.pem", host, router, state)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[RunningEngine]:
    """A simulated vLLM as hostd launches one that may park (its development controls on),
    whose answer runs for a long time unless max_tokens ends it (15 s at 200 tokens a second)."""
    work = short_dir("ingress-engine")
    simgpu = work / "simgpu"
    make_devices(simgpu)
    behaviour = FAST.model_copy(update={"answer": ANSWER})
    install = install_python_engine(work / "vllm", "vllm", "0.29.0", behaviour)
    running = launch(install, work, model, simgpu_dir=simgpu, residency=Residency.HOST_BACKED)
    yield running
    running.stop()
    shutil.rmtree(work, ignore_errors=True)


class Served:
    """The ingress served as hostd serves it, in a thread with its own event loop."""

    def __init__(self, paths: StatePaths, engine: RunningEngine, redis_socket: Path) -> None:
        self.port = free_port()
        self.door = HostIngress.open(f"127.0.0.1:{self.port}", paths)
        self.engines = {f"{DEPLOYMENT}:0": Engine(engine.spec, engine.proc.pid, engine.log)}
        self.redis_url = f"unix://{redis_socket}"
        self.loop = asyncio.new_event_loop()
        self.stop = asyncio.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),))
        self.thread.start()

    async def _run(self) -> None:
        client = redis_client(self.redis_url)
        try:
            state = State(client)
            serving = Serving(state.instances(HOST), state, HOST)
            await self.door.serve(self.engines, serving, self.stop)
        finally:
            await client.aclose()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)
        self.loop.close()
        assert not self.thread.is_alive()


def record(redis_socket: Path, state: InstanceState, generation: int = GENERATION) -> None:
    """Write the instance's record through the store, as hostd and the scheduler do."""

    async def write() -> None:
        client = redis_client(f"unix://{redis_socket}")
        try:
            store = State(client).instances(HOST)
            current = await store.get(DEPLOYMENT, 0)
            new = instance_record(DEPLOYMENT, HOST, generation=generation, state=state)
            await store.transition(
                new,
                allowed=[current.state if current else "absent"],
                generation=None,
                reason="test",
                previous=current,
            )
        finally:
            await client.aclose()

    asyncio.run(write())


@pytest.fixture
def served(certificates: Pki, engine: RunningEngine, redis_socket: Path) -> Iterator[Served]:
    record(redis_socket, InstanceState.READY)
    running = Served(certificates.state, engine, redis_socket)
    yield running
    running.close()


def addressed(generation: int = GENERATION) -> dict[str, str]:
    return {
        ingress.DEPLOYMENT_HEADER: DEPLOYMENT,
        ingress.INSTANCE_HEADER: "0",
        ingress.GENERATION_HEADER: str(generation),
    }


def router_client(certificates: Pki, served: Served) -> httpx.Client:
    return httpx.Client(
        base_url=f"https://127.0.0.1:{served.port}",
        verify=certificates.router.context(certificates.ca),
        headers=addressed(),
        timeout=30,
    )


def via_ingress(certificates: Pki, served: Served) -> openai.OpenAI:
    """The openai SDK (on its own fork of httpx), with the router's certificate and a key
    the engine does not know: the ingress drops it for the engine's own."""
    http = httpx2.Client(
        verify=certificates.router.context(certificates.ca), headers=addressed(), timeout=30
    )
    return openai.OpenAI(
        base_url=f"https://127.0.0.1:{served.port}/v1",
        api_key="not-the-engines-key",
        http_client=http,
        max_retries=0,
    )


def metrics(engine: RunningEngine) -> dict[str, float]:
    """The engine's own counts of requests: running, and ended by an abort."""
    text = httpx.get(f"{engine.base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    running = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    aborted = re.search(r'^vllm:request_success_total\{[^}]*"abort"[^}]*\} (\S+)$', text, re.M)
    assert running is not None, text
    assert aborted is not None, text
    return {"running": float(running[1]), "aborted": float(aborted[1])}


def test_the_routers_certificate_gets_the_engines_own_answer(
    certificates: Pki, served: Served, engine: RunningEngine
) -> None:
    def streamed(sdk: openai.OpenAI) -> list[str]:
        stream = sdk.chat.completions.create(**CHAT, max_tokens=24, stream=True)  # type: ignore[call-overload]
        return [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]

    with engine.openai() as direct_sdk, via_ingress(certificates, served) as sdk:
        direct = direct_sdk.chat.completions.create(**CHAT, max_tokens=24)  # type: ignore[call-overload]
        through = sdk.chat.completions.with_raw_response.create(  # type: ignore[call-overload]
            **CHAT, max_tokens=24, extra_headers={"X-Request-Id": "through-the-ingress"}
        )
        reply = through.parse()
        assert through.headers["content-type"] == "application/json"
        assert reply.choices[0].message.content == direct.choices[0].message.content
        assert reply.choices[0].message.content
        assert reply.id == "chatcmpl-through-the-ingress", "the request id reached the engine"

        pieces = streamed(sdk)
        assert pieces == streamed(direct_sdk)
        assert len([piece for piece in pieces if piece]) > 5, "token by token"


def test_a_stream_flows_token_by_token(
    certificates: Pki, served: Served, engine: RunningEngine
) -> None:
    """Each event leaves the ingress as the engine sends it (200 tokens a second here), not
    when the answer ends."""
    body = {**CHAT, "max_tokens": 60, "stream": True}
    arrivals = []
    with (
        router_client(certificates, served) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    assert len(arrivals) > 50
    spread = arrivals[-1] - arrivals[0]
    assert spread > 0.15, f"the events came together, in {spread:.3f} s"


def test_another_generation_or_a_state_that_does_not_serve_is_stale(
    certificates: Pki, served: Served, engine: RunningEngine, redis_socket: Path
) -> None:
    """A record that turns to serving passes at once (the ingress reads it when its view has
    not caught up yet); one that stops serving is refused once the ingress heard of it, a
    notification later."""
    short = {**CHAT, "max_tokens": 2}
    with router_client(certificates, served) as client:

        def status(generation: int = GENERATION) -> int:
            answer = client.post("/v1/chat/completions", json=short, headers=addressed(generation))
            return answer.status_code

        def refused(generation: int = GENERATION) -> bool:
            return status(generation) == ingress.STALE_STATUS

        stale = client.post("/v1/chat/completions", json=short, headers=addressed(GENERATION - 1))
        assert stale.status_code == ingress.STALE_STATUS
        error = stale.json()["error"]
        assert error["code"] == ingress.STALE_CODE
        assert error["type"] == "invalid_request_error"
        assert (
            f"instance {DEPLOYMENT}:0 does not serve at generation {GENERATION - 1}"
            in (error["message"])
        )
        other = dict(addressed(), **{ingress.INSTANCE_HEADER: "1"})
        assert client.post("/v1/chat/completions", json=short, headers=other).status_code == 409

        # Draining still serves what was admitted; parking does not.
        record(redis_socket, InstanceState.DRAINING)
        assert status() == 200
        record(redis_socket, InstanceState.PARKING)
        wait_for(refused, timeout=5, what="the ingress to refuse a parking instance")
        # Back to ready at a new generation: the new one passes at once, the old one not.
        record(redis_socket, InstanceState.READY, GENERATION + 1)
        assert status(GENERATION + 1) == 200
        assert refused(GENERATION)


def test_a_request_that_names_no_instance_is_refused(certificates: Pki, served: Served) -> None:
    with router_client(certificates, served) as client:
        for headers, says in (
            ({ingress.GENERATION_HEADER: ""}, "is not a number"),
            ({ingress.GENERATION_HEADER: "3a"}, "is not a number"),
            ({ingress.INSTANCE_HEADER: "-1"}, "is not a number"),
            ({ingress.DEPLOYMENT_HEADER: "Tiny!"}, "is not a deployment"),
        ):
            answer = client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert answer.status_code == 400, headers
            assert answer.json()["error"]["code"] == "invalid_request"
            assert says in answer.json()["error"]["message"]
        del client.headers[ingress.DEPLOYMENT_HEADER]
        missing = client.post("/v1/chat/completions", json=CHAT)
        assert missing.status_code == 400
        assert f"names no {ingress.DEPLOYMENT_HEADER}" in missing.json()["error"]["message"]


def test_only_the_inference_paths_reach_the_engine(
    certificates: Pki, served: Served, engine: RunningEngine
) -> None:
    """The engine's controls answer its key; the ingress holds that key, and never lets them
    through. A 404 here is the ingress's own answer, not the engine's."""
    with router_client(certificates, served) as client:
        for method, path in (
            ("GET", "/v1/models"),
            ("GET", "/v1/chat/completions"),
            ("POST", "/sleep?level=1"),
            ("POST", "/wake_up"),
            ("POST", "/abort_request"),
            ("POST", "/v1/chat/completions/../../sleep"),
        ):
            answer = client.request(method, path, json={})
            assert answer.status_code == 404, (method, path)
            error = answer.json()["error"]
            assert (error["code"], error["type"]) == ("not_found", "not_found_error")
            assert error["message"].startswith("the ingress forwards only POST to ")
    sleeping = httpx.get(
        f"{engine.base_url}/is_sleeping", headers={"Authorization": f"Bearer {KEY}"}
    )
    assert sleeping.json() == {"is_sleeping": False}


def test_a_hang_up_in_mid_stream_ends_the_engines_request(
    certificates: Pki, served: Served, engine: RunningEngine
) -> None:
    before = metrics(engine)
    assert before["running"] == 0
    body = {**CHAT, "max_tokens": 3000, "stream": True}  # 15 s of tokens
    with (
        router_client(certificates, served) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as answer,
    ):
        lines = answer.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert metrics(engine)["running"] == 1
    left = time.monotonic()  # the client's connection closed as the block ended

    def ended() -> dict[str, float] | None:
        now = metrics(engine)
        return now if now["running"] == 0 else None

    after = wait_for(ended, timeout=5, what="the engine to end the request", interval=0.02)
    assert time.monotonic() - left < 1.0
    assert after["aborted"] == before["aborted"] + 1


def raw_request(port: int, context: ssl.SSLContext) -> tuple[bytes, BaseException | None]:
    """What the ingress sends back on one TLS connection to a request that names no
    instance: (bytes read, the error that ended the connection, if any)."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with context.wrap_socket(raw) as tls:
                tls.sendall(
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                    b"Content-Length: 2\r\n\r\n{}"
                )
                while chunk := tls.recv(4096):
                    got += chunk
        except (ssl.SSLError, OSError) as exc:
            return got, exc
    return got, None


def test_a_hosts_certificate_is_refused_before_anything_is_served(
    certificates: Pki, served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    """A host's certificate is of the server's authority and passes the handshake; the
    ingress closes the connection as it opens, reads nothing and answers nothing."""
    with caplog.at_level(logging.WARNING, logger="capycommon.httpguard"):
        got, _ = raw_request(served.port, certificates.host.context(certificates.ca))
        answered, _ = raw_request(served.port, certificates.router.context(certificates.ca))
    assert got == b""
    assert answered.startswith(b"HTTP/1.1 400 "), "the router's is answered"
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 1
    assert (
        f"its certificate ({HOST!r}, a host's) is not a router's; only the server's router"
        in refusals[0]
    )


@pytest.mark.parametrize("version", [ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3])
def test_no_client_certificate_fails_the_handshake(
    certificates: Pki, served: Served, version: ssl.TLSVersion
) -> None:
    """Nor does a router's certificate of another authority pass. Over TLS 1.2 the client
    sees its handshake fail; over TLS 1.3 its handshake ends before the ingress checks its
    certificate, and the ingress's failure shows as a connection closed with no answer."""
    folder = certificates.ca.parent.parent
    stranger = Authority.ensure(folder / "stranger", "stranger")
    foreign = issue(stranger, folder, "router", "router", f"foreign-router-{version.name}")
    for identity in (None, foreign):
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.maximum_version = version
        context.load_verify_locations(cafile=certificates.ca)
        context.check_hostname = False
        if identity is not None:
            context.load_cert_chain(identity.cert, identity.key)
        got, error = raw_request(served.port, context)
        assert got == b"", identity
        if version is ssl.TLSVersion.TLSv1_2:
            assert isinstance(error, ssl.SSLError), identity


def test_a_renewed_certificate_is_presented_to_new_connections(
    certificates: Pki, served: Served
) -> None:
    def presented() -> Any:
        context = certificates.router.context(certificates.ca)
        with (
            socket.create_connection(("127.0.0.1", served.port), timeout=10) as raw,
            context.wrap_socket(raw) as tls,
        ):
            der = tls.getpeercert(binary_form=True)
        assert der is not None
        return pki.read_certificate(ssl.DER_cert_to_PEM_cert(der).encode()).serial

    first = presented()
    renewed = issue(certificates.authority, certificates.ca.parent.parent, "host", HOST, "renewed")
    write_atomic(
        certificates.state.host_certificate, renewed.cert.read_text() + renewed.key.read_text()
    )
    served.loop.call_soon_threadsafe(served.door.reload)
    serial = pki.read_certificate(renewed.cert.read_bytes()).serial
    wait_for(lambda: presented() == serial, timeout=5, what="the renewed certificate")
    assert serial != first


def test_refusals_are_json_in_the_openai_envelope(certificates: Pki, served: Served) -> None:
    with router_client(certificates, served) as client:
        answer = client.post("/v1/embeddings", json={}, headers=addressed(99))
    assert answer.headers["content-type"] == "application/json"
    assert set(json.loads(answer.content)["error"]) == {"message", "type", "param", "code"}


def test_a_host_that_did_not_join_serves_no_ingress(hostd: tuple[Hostd, str]) -> None:
    """A host given a redis.url (a standalone role's hostd, as here) reaches no server: it
    serves no ingress, and says so."""
    harness, _ = hostd
    raw = wait_for(
        lambda: harness.client.get(keys.host_info(HARNESS_HOST)), timeout=10, what="host info"
    )
    assert isinstance(raw, bytes)
    assert HostInfo.model_validate_json(raw) == HostInfo(
        version=__version__, capabilities=HOST_CAPABILITIES, deep_park=True, ingress=None
    )


def connections_to(port: int) -> int:
    """Established TCP connections on this machine whose far end is 127.0.0.1:`port`."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        _, _, remote, state, *_ = line.split()
        if remote == f"0100007F:{port:04X}" and state == "01":
            count += 1
    return count


def test_connections_to_the_engine_are_kept_between_requests(
    certificates: Pki, served: Served, engine: RunningEngine
) -> None:
    assert connections_to(engine.spec.port) == 0
    with router_client(certificates, served) as client:
        for streamed in (False, True, False, True, False):
            body = {**CHAT, "max_tokens": 3, "stream": streamed}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert connections_to(engine.spec.port) == 1
