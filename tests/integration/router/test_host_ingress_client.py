"""A server's router in front of a joined host's ingress: the real app on a real socket, a
real redis-server, and a TLS server of the test's own standing for the ingress, with a host
certificate of the server's authority. The router presents the certificate the server start
issued it, names the instance in the ingress's headers and sends no engine key; answers come
through token by token; a peer that is not the host it meant to reach is refused at once; the
ingress's 409 stale_dispatch is the client's 503 unavailable."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capycommon import ingress, pki
from capycommon.authority import Authority
from capycommon.credentials import generate
from capycommon.domain.hosts import HostIdentity, HostInfo
from capycommon.engineclient import Engines
from capycommon.paths import StatePaths, ensure_private_dir
from capycommon.service import redis_client
from capycommon.settings import ConnectionLimits
from capycommon.state.stores import State
from capyctl_cli import serveridentity
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher, Limits
from capyctl_router.metrics import Metrics
from capyctl_router.remote import client_context
from capyctl_router.table import Table
from integration.common.served import served
from integration.router.fakeengine import engine_serving
from integration.router.ready import chunk, put_ready
from ports import free_port
from support import short_dir, wait_for_async

CREDENTIALS = generate()
HOST = "gpu-a"
NAME = "m"
HI: list[Any] = [{"role": "user", "content": "hi"}]
# What put_ready keeps as the engine's key: the router must not send it to an ingress.
ENGINE_KEY = "engine-key"


def _issued(
    authority: Authority, folder: Path, kind: pki.Kind, identity: str, name: str = HOST
) -> Path:
    """A certificate the authority issues (a host's: clientAuth and serverAuth) and its key,
    in one file."""
    key = pki.new_private_key()
    request = pki.certificate_request(key, name)
    certificate = authority.sign_request(
        request, kind=kind, name=name, identity=identity, lifetime=timedelta(hours=1)
    )
    file = folder / f"{kind}-{identity}.pem"
    file.write_bytes(certificate + key)
    return file


def _host_certificate(server: Server) -> Path:
    """The joined host's own certificate."""
    return _issued(server.authority, server.paths.root, "host", server.host_id)


def _serving_router_certificate(server: Server, folder: Path) -> Path:
    """A certificate of the server's authority that may serve TLS but names a router, not a
    host (the authority issues none such: a router's is clientAuth only)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    uri = x509.UniformResourceIdentifier(f"{pki.URI_PREFIX}router:{server.router_id}")
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "capyctl-router")]))
        .issuer_name(server.authority.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(x509.SubjectAlternativeName([uri]), critical=False)
        .sign(server.authority.key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    file = folder / "serving-router.pem"
    file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM) + key_pem)
    return file


def _server_context(authority: Authority, certificate: Path) -> ssl.SSLContext:
    """An ingress's TLS: its own certificate, and one of the server's authority required of
    the client."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=authority.certificate_pem.decode())
    context.load_cert_chain(certificate)
    return context


def _sse(*events: str) -> httpx.Response:
    body = "".join(events).encode()
    return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


@dataclass
class Server:
    """A server's state dir (its authority, the router's certificate) and its Redis, with
    host HOST joined and its deployment NAME ready at generation 1."""

    paths: StatePaths
    authority: Authority
    state: State
    host_id: str = field(default_factory=pki.new_identity)

    @property
    def router_id(self) -> str:
        return self.paths.router_id.read_text().strip()

    async def join(self, ingress_port: int | None) -> None:
        """HOST joined, its ingress on `ingress_port` (None: not published yet)."""
        now = time.time()
        record = HostIdentity(
            name=HOST,
            host_id=self.host_id,
            serial="1",
            not_after=now + 3600,
            version="test",
            joined_at=now,
        )
        await self.state.identities.put(record)
        await self.state.host_info.join(HOST)
        if ingress_port is not None:
            await self.publish(ingress_port)

    async def publish(self, ingress_port: int) -> None:
        info = HostInfo(ingress=f"127.0.0.1:{ingress_port}")
        await self.state.host_info.publish(HOST, info)

    async def running(self) -> int:
        return (await self.state.places.get(NAME)).running


@pytest.fixture
async def server(redis_socket: Path) -> AsyncIterator[Server]:
    folder = short_dir("ingress")
    paths = StatePaths(folder / "state")
    ensure_private_dir(paths.identity_dir)
    authority = Authority.ensure(paths.authority_dir, "capyctl test authority")
    serveridentity.issue_router_certificate(paths, authority)
    state = State(redis_client(f"unix://{redis_socket}"))
    await put_ready(state.client, NAME, host=HOST, secret=ENGINE_KEY)
    try:
        yield Server(paths, authority, state)
    finally:
        await state.client.aclose()
        shutil.rmtree(folder, ignore_errors=True)


# A request the ingress never took is admitted again until its deadline: the tests of such
# failures give it this one.
DEADLINE_S = 2.0


@contextlib.asynccontextmanager
async def router(server: Server, deadline_s: float = 30.0) -> AsyncIterator[tuple[Dispatcher, int]]:
    """The router as a server role runs it (no host of its own; the router's certificate
    for the ingresses), following Redis, served on a loopback port; requests wait at most
    `deadline_s`."""
    table = Table(server.state, set())
    engines = Engines(tls=client_context(server.paths))
    limits = Limits(request_deadline_s=deadline_s)
    dispatcher = Dispatcher(server.state, table, Metrics(), limits)
    app = create_app(CREDENTIALS, Router(dispatcher, engines))
    stop = asyncio.Event()
    following = asyncio.create_task(table.run(stop))
    try:
        await asyncio.wait_for(table.synced.wait(), 10)
        async with served(app, ConnectionLimits()) as port:
            yield dispatcher, port
    finally:
        stop.set()
        await following
        engines.close()


@contextlib.asynccontextmanager
async def sdk(port: int) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key=CREDENTIALS.api_key, max_retries=0
    )
    try:
        yield client
    finally:
        await client.close()


@dataclass
class Ingress:
    """What the test's ingress saw, and the engine behind it (`engine`)."""

    engine: Callable[[httpx.Request], httpx.Response]
    seen: list[httpx.Request] = field(default_factory=list)

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.engine(request)


def _check_forwarded(request: httpx.Request, server: Server) -> None:
    """The request as an ingress must get it: the instance named, no engine key, from the
    router's certificate."""
    assert request.url.path in ingress.PATHS
    assert request.headers[ingress.DEPLOYMENT_HEADER] == NAME
    assert request.headers[ingress.INSTANCE_HEADER] == "0"
    assert request.headers[ingress.GENERATION_HEADER] == "1"
    assert request.headers["x-request-id"]
    assert "authorization" not in request.headers
    assert ENGINE_KEY not in request.content.decode()
    peer = pki.read_certificate(ssl.DER_cert_to_PEM_cert(request.extensions["peercert"]).encode())
    assert (peer.kind, peer.identity) == ("router", server.router_id)


@pytest.mark.anyio
async def test_answers_come_through_the_hosts_ingress(server: Server) -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/embeddings":
            data = [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}]
            return httpx.Response(200, json={"object": "list", "data": data, "model": "served"})
        return _sse(chunk("hel"), chunk("lo", "stop"), "data: [DONE]\n\n")

    found = Ingress(engine)
    tls = _server_context(server.authority, _host_certificate(server))
    async with engine_serving(found.answer, tls) as port:
        await server.join(port)
        async with router(server) as (_, router_port), sdk(router_port) as client:
            stream = await client.chat.completions.create(model=NAME, messages=HI, stream=True)
            pieces = [c.choices[0].delta.content async for c in stream if c.choices]
            assert "".join(p or "" for p in pieces) == "hello"
            whole = await client.chat.completions.create(model=NAME, messages=HI)
            assert whole.choices[0].message.content == "hello"
            embedded = await client.embeddings.create(model=NAME, input="hi")
            assert embedded.data[0].embedding == [0.5, 0.25]
    assert [r.url.path for r in found.seen] == [
        "/v1/chat/completions",
        "/v1/chat/completions",
        "/v1/embeddings",
    ]
    for request in found.seen:
        _check_forwarded(request, server)
    assert json.loads(found.seen[0].content)["model"] == "served"
    assert await server.running() == 0


@pytest.mark.anyio
async def test_tokens_pass_one_by_one_and_a_hang_up_closes_the_ingress_connection(
    server: Server,
) -> None:
    go = asyncio.Event()
    closed = asyncio.Event()

    async def ingress_side(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One streamed answer: a first event, a second once `go` is set, then nothing more
        until the router closes the connection."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        writer.write(b"transfer-encoding: chunked\r\n\r\n")
        for event in (chunk("first"), chunk("second")):
            data = event.encode()
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
            await go.wait()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # b"" once the router closed its side
        closed.set()
        writer.close()

    tls = _server_context(server.authority, _host_certificate(server))
    listener = await asyncio.start_server(ingress_side, "127.0.0.1", 0, ssl=tls)
    async with listener:
        await server.join(int(listener.sockets[0].getsockname()[1]))
        async with router(server) as (_, router_port):
            body = {"model": NAME, "messages": HI, "stream": True}
            headers = {"Authorization": f"Bearer {CREDENTIALS.api_key}"}
            async with (
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{router_port}") as http,
                http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer,
            ):
                assert answer.status_code == 200
                lines = answer.aiter_lines()
                first = await asyncio.wait_for(anext(lines), 10)
                assert "first" in first, "the first token came before the second was sent"
                go.set()
                while "second" not in await asyncio.wait_for(anext(lines), 10):
                    pass
            # The client hung up mid-stream: the ingress's connection closes at once.
            await asyncio.wait_for(closed.wait(), 5)
            await wait_for_async(
                lambda: _settled(server), timeout=10, what="the cut request's place counted"
            )


async def _settled(server: Server) -> bool:
    """The cut request holds its place until the engine reads idle, as on loopback."""
    found = await server.state.places.get(NAME)
    return (found.running, found.settle_when_idle) == (1, 1)


def _wrong_identity(server: Server, folder: Path) -> Path:
    """Another joined host's certificate."""
    return _issued(server.authority, folder, "host", pki.new_identity(), name="gpu-b")


def _routers_own(server: Server, _: Path) -> Path:
    """The certificate the router itself presents (clientAuth only)."""
    return server.paths.router_certificate


def _other_authority(server: Server, folder: Path) -> Path:
    """The host's name and id, from another server's authority."""
    stranger = Authority.create(folder / "stranger", "another authority")
    return _issued(stranger, folder, "host", server.host_id)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("presented", "said"),
    [
        (_wrong_identity, "not that of host gpu-a"),
        (_serving_router_certificate, "a router's) is not a host's"),
        (_routers_own, "unsuitable certificate purpose"),
        (_other_authority, "certificate verify failed"),
    ],
)
async def test_a_peer_that_is_not_the_host_is_refused(
    server: Server, presented: Callable[[Server, Path], Path], said: str
) -> None:
    found = Ingress(lambda _: _sse(chunk("hello", "stop"), "data: [DONE]\n\n"))
    tls = _server_context(server.authority, presented(server, server.paths.root))
    async with engine_serving(found.answer, tls) as port:
        await server.join(port)
        async with (
            router(server, deadline_s=DEADLINE_S) as (_, router_port),
            sdk(router_port) as client,
        ):
            started = time.monotonic()
            with pytest.raises(openai.APIStatusError) as refused:
                await client.chat.completions.create(model=NAME, messages=HI)
            assert time.monotonic() - started < DEADLINE_S + 3, "refused at its deadline"
    assert refused.value.status_code == 503
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["code"] == "engine_unreachable"
    assert f"the ingress of host {HOST} at 127.0.0.1:{port}" in error["message"]
    assert said in error["message"]
    assert found.seen == [], "nothing was sent to it"
    assert await server.running() == 0


@pytest.mark.anyio
async def test_an_ingress_nobody_serves_is_unreachable(server: Server) -> None:
    await server.join(free_port())
    async with (
        router(server, deadline_s=DEADLINE_S) as (_, router_port),
        sdk(router_port) as client,
    ):
        with pytest.raises(openai.APIStatusError) as refused:
            await client.chat.completions.create(model=NAME, messages=HI, stream=True)
    assert refused.value.status_code == 503
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["code"] == "engine_unreachable"
    assert await server.running() == 0


@pytest.mark.anyio
@pytest.mark.parametrize("streams", [True, False])
async def test_a_stale_dispatch_is_503_unavailable(server: Server, streams: bool) -> None:
    def stale(_: httpx.Request) -> httpx.Response:
        error = {"message": "m:0 is not running generation 1", "code": ingress.STALE_CODE}
        return httpx.Response(ingress.STALE_STATUS, json={"error": error})

    tls = _server_context(server.authority, _host_certificate(server))
    async with engine_serving(Ingress(stale).answer, tls) as port:
        await server.join(port)
        async with router(server, deadline_s=DEADLINE_S) as (_, router_port):
            body = {"model": NAME, "messages": HI, "stream": streams}
            headers = {"Authorization": f"Bearer {CREDENTIALS.api_key}"}
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router_port}") as http:
                answer = await http.post("/v1/chat/completions", json=body, headers=headers)
    assert answer.status_code == 503
    assert answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "unavailable"
    assert "stopped or moved on host gpu-a" in answer.json()["error"]["message"]
    assert await server.running() == 0, "given back at once"


@pytest.mark.anyio
async def test_a_request_the_ingress_never_took_is_admitted_again_once_it_moved(
    server: Server,
) -> None:
    """Nothing serves the ingress the table knows (the host just went away): the request
    goes back to waiting, and is sent where the host serves once the table says so."""
    found = Ingress(lambda _: _sse(chunk("hello", "stop"), "data: [DONE]\n\n"))
    tls = _server_context(server.authority, _host_certificate(server))
    async with engine_serving(found.answer, tls) as port:
        await server.join(free_port())
        async with router(server) as (_, router_port), sdk(router_port) as client:
            asking = asyncio.create_task(client.chat.completions.create(model=NAME, messages=HI))
            await asyncio.sleep(1.5)  # refused by the address nobody serves, again and again
            assert not asking.done()
            assert found.seen == []
            await server.publish(port)
            whole = await asyncio.wait_for(asking, 10)
    assert whole.choices[0].message.content == "hello"
    assert len(found.seen) == 1
    assert await server.running() == 0


@pytest.mark.anyio
async def test_a_request_waits_until_the_host_publishes_its_ingress(server: Server) -> None:
    found = Ingress(lambda _: _sse(chunk("hello", "stop"), "data: [DONE]\n\n"))
    tls = _server_context(server.authority, _host_certificate(server))
    async with engine_serving(found.answer, tls) as port:
        await server.join(None)
        async with router(server) as (dispatcher, router_port), sdk(router_port) as client:
            table = dispatcher.table
            assert table.instances[NAME].host == HOST
            assert table.target(NAME) is None, "no ingress known: not a target yet"
            asking = asyncio.create_task(client.chat.completions.create(model=NAME, messages=HI))

            async def waiting() -> bool:
                return dispatcher.book.waiting[NAME] == 1

            await wait_for_async(waiting, timeout=10, what="the request in the queue")
            assert not asking.done()
            await server.publish(port)  # the host announces itself: the table reads it
            whole = await asyncio.wait_for(asking, 10)
    assert whole.choices[0].message.content == "hello"
    assert len(found.seen) == 1
