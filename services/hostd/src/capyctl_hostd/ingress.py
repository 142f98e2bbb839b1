"""The host's ingress: where the server's router reaches the engines of a joined host, over
mutual TLS (the wire is `capycommon.ingress`).

hostd serves it on `host.ingress.bind`, presenting the host's certificate (`host.pem`, which
a renewal replaces: `HostIngress.reload` loads it for the connections that follow) and
requiring one of the server's authority (`server-ca.pem`). A connection is served only when
that certificate is the router's (`urn:capyctl:router:<id>`); any other, a host's included,
is closed as it opens and logged.

A request passes only as a POST to an inference path (else 404) naming its instance and
generation (else 400), and only while that instance's engine is held here and serves at
that generation (else 409 `stale_dispatch`); refusals are in the OpenAI error envelope, as
the router's own. It goes to the engine on loopback as it came, with its Content-Type and
X-Request-Id and the engine's own key instead of any Authorization it carried. The engine's
status, Content-Type and body come back as the engine sends them, chunk by chunk. When the
router hangs up, the engine's connection is closed at once, which is how the engine learns
that its client left. Connections to engines are kept between requests
(`capycommon.engineclient`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.types import Message, Receive, Scope, Send

from capycommon import ingress, pki
from capycommon.domain.deployment import NAME_PATTERN
from capycommon.engineclient import EngineConnectionError, Engines
from capycommon.errors import (
    CapyError,
    CertificateInvalid,
    CredentialsUnusable,
    EngineUnreachable,
    InvalidRequest,
    NotFound,
    RedisUnreachable,
    StaleDispatch,
)
from capycommon.hangup import Watch, uncancel
from capycommon.httpserve import bind, serve_http
from capycommon.paths import StatePaths
from capycommon.service import REDIS_ERRORS
from capycommon.settings import ConnectionLimits
from capycommon.tasks import beside
from capyctl_hostd.engines import Engine
from capyctl_hostd.serving import Serving

log = logging.getLogger(__name__)

# Where the engines listen, from the ingress's side.
ENGINE_ADDRESS = "127.0.0.1"
# The router holds a connection per request in flight, all from the server's one address.
LIMITS = ConnectionLimits(connections_per_client=4096)
DEPLOYMENT_NAME = re.compile(NAME_PATTERN)
# An instance's index or a generation: a number of at most this many digits.
MAX_DIGITS = 18
REJOIN = (
    "join this host again: on the server `capyctl revoke host NAME` and `capyctl invite host "
    "NAME --recover`, then here `capyctl join host --join-file FILE --recover`"
)
_TYPES = {404: "not_found_error"}


def tls_context(paths: StatePaths) -> ssl.SSLContext:
    """The ingress's TLS: the host's certificate, and a client certificate required of the
    server's authority. Refused, naming the file, when either cannot be loaded."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_mode = ssl.CERT_REQUIRED
    try:
        context.load_verify_locations(cafile=paths.joined_authority)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialsUnusable(
            f"cannot load the server's certificate authority {paths.joined_authority} ({exc}); "
            f"{REJOIN}"
        ) from None
    try:
        context.load_cert_chain(paths.host_certificate)
    except (OSError, ssl.SSLError) as exc:
        raise CredentialsUnusable(
            f"cannot load the host's certificate {paths.host_certificate} ({exc}); {REJOIN}"
        ) from None
    return context


def admit_router(transport: asyncio.Transport) -> str | None:
    """None for a connection of the server's router; else why it is refused. Its certificate
    was already checked against the server's authority: here, that it is a router's."""
    try:
        pki.peer_of_kind(transport, "router")
    except CertificateInvalid as exc:
        return f"{exc.message}; only the server's router sends requests to an ingress"
    return None


@dataclass
class HostIngress:
    """The ingress as hostd runs it: its listener, bound at once (a port in use fails
    hostd's start, before it says where its ingress is), and its TLS context."""

    address: str
    paths: StatePaths
    context: ssl.SSLContext
    listener: socket.socket

    @classmethod
    def open(cls, address: str, paths: StatePaths) -> HostIngress:
        context = tls_context(paths)
        return cls(address, paths, context, bind(address))

    def reload(self) -> None:
        """Present the host's certificate as it is now (after a renewal) to the connections
        that follow; those open keep theirs."""
        try:
            self.context.load_cert_chain(self.paths.host_certificate)
        except (OSError, ssl.SSLError) as exc:
            log.error(
                "the ingress keeps its certificate: cannot load %s: %s",
                self.paths.host_certificate,
                exc,
            )
            return
        log.info("the ingress presents the renewed host certificate")

    async def serve(
        self, engines: Mapping[str, Engine], serving: Serving, stop: asyncio.Event
    ) -> None:
        """Serve until `stop` is set, forwarding to `engines` (hostd's, by member) while
        `serving` says they serve."""
        app = Ingress(engines, serving)
        try:
            async with beside(serving.follow(stop), "the ingress's view of the instances"):
                await serve_http(
                    app,
                    self.address,
                    stop,
                    LIMITS,
                    listener=self.listener,
                    tls=self.context,
                    admit=admit_router,
                )
        finally:
            app.close()


@dataclass(frozen=True)
class Forwarded:
    """How an admitted request goes to its engine: its path, its Content-Type and the other
    headers it carries there."""

    path: str
    content_type: str
    headers: dict[str, str]


class Ingress:
    """The ingress's ASGI app."""

    def __init__(self, engines: Mapping[str, Engine], serving: Serving) -> None:
        self.engines = engines
        self.serving = serving
        self.upstream = Engines()

    def close(self) -> None:
        self.upstream.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            engine, request = await self._admitted(scope)
        except CapyError as exc:
            await _refuse(send, exc)
            return
        body = await _body(receive)
        if body is not None:
            await self._forward(engine, request, body, receive, send)

    async def _admitted(self, scope: Scope) -> tuple[Engine, Forwarded]:
        """The engine the request goes to and how it goes; refused otherwise."""
        if scope["method"] != "POST" or scope["path"] not in ingress.PATHS:
            raise NotFound(
                f"the ingress forwards only POST to {', '.join(sorted(ingress.PATHS))}, not "
                f"{scope['method']} {scope['path']}"
            )
        found = _headers(scope["headers"])
        deployment, instance, generation = _instance(found)
        member = f"{deployment}:{instance}"
        if not await self._serves(member, generation):
            raise StaleDispatch(
                f"instance {member} does not serve at generation {generation} on host "
                f"{self.serving.host} (it stopped, moved or is switching); send the request "
                "where it runs now"
            )
        engine = self.engines.get(member)
        if engine is None:
            raise StaleDispatch(
                f"host {self.serving.host} holds no engine for instance {member}; send the "
                "request where it runs now"
            )
        headers = {"authorization": f"Bearer {engine.spec.api_key}"}
        if "x-request-id" in found:
            headers["x-request-id"] = found["x-request-id"]
        content_type = found.get("content-type", "application/json")
        return engine, Forwarded(scope["path"], content_type, headers)

    async def _serves(self, member: str, generation: int) -> bool:
        if self.serving.serves(member, generation):
            return True
        try:
            return await self.serving.confirm(member, generation)
        except REDIS_ERRORS as exc:
            raise RedisUnreachable(
                f"cannot read instance {member}'s state from Redis ({exc}); the request was "
                "not forwarded"
            ) from None

    async def _forward(
        self, engine: Engine, request: Forwarded, body: bytes, receive: Receive, send: Send
    ) -> None:
        """Relay the engine's answer as it comes; a hang-up closes the engine's connection."""
        port = engine.spec.port
        watch = Watch(receive)
        answer = None
        try:
            answer = await self.upstream.post(
                ENGINE_ADDRESS, port, request.path, body, request.headers, request.content_type
            )
            head = {"type": "http.response.start", "status": answer.status}
            await send({**head, "headers": _answer_head(answer.headers)})
            while chunk := await answer.receive():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            watch.ending()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.gone:
                raise
            uncancel()
            log.debug("the router hung up; closed the engine's connection on port %d", port)
        except EngineConnectionError as exc:
            if answer is None:
                message = f"the engine on port {port} did not answer: {exc}"
                await _refuse(send, EngineUnreachable(message))
            else:  # the answer ends short, and the router sees it cut
                log.warning("the engine on port %d broke off its answer: %s", port, exc)
        finally:
            watch.stop()
            if answer is not None:
                answer.close()


# The request headers the ingress reads; every other one stays here.
_READ = frozenset(
    name.encode()
    for name in (
        ingress.DEPLOYMENT_HEADER,
        ingress.INSTANCE_HEADER,
        ingress.GENERATION_HEADER,
        "content-type",
        "x-request-id",
    )
)


def _headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {name.decode(): value.decode("latin-1") for name, value in raw if name in _READ}


def _instance(found: Mapping[str, str]) -> tuple[str, int, int]:
    """(deployment, instance, generation) the request names; InvalidRequest otherwise."""
    names = (ingress.DEPLOYMENT_HEADER, ingress.INSTANCE_HEADER, ingress.GENERATION_HEADER)
    missing = [name for name in names if name not in found]
    if missing:
        raise InvalidRequest(
            f"the request names no {', '.join(missing)}; the server's router sends each "
            "request with the instance it was admitted to"
        )
    deployment, instance, generation = (found[name] for name in names)
    if not DEPLOYMENT_NAME.fullmatch(deployment):
        raise InvalidRequest(f"{ingress.DEPLOYMENT_HEADER} {deployment!r} is not a deployment")
    for name, value in ((names[1], instance), (names[2], generation)):
        if not (value.isascii() and value.isdigit() and len(value) <= MAX_DIGITS):
            raise InvalidRequest(f"{name} {value!r} is not a number")
    return deployment, int(instance), int(generation)


async def _body(receive: Receive) -> bytes | None:
    """The request's body; None when the router hung up before sending all of it."""
    parts: list[bytes] = []
    message: Message = {"more_body": True}
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        parts.append(message.get("body", b""))
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _answer_head(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    head = []
    for name in ("content-type", "content-length"):
        value = headers.get(name)
        if value is not None:
            head.append((name.encode(), value.encode("latin-1")))
    return head


async def _refuse(send: Send, error: CapyError) -> None:
    """The ingress's own answer, in the OpenAI error envelope (as the router answers)."""
    status = error.http_status
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    inner = {"message": error.message, "type": kind, "param": None, "code": error.code}
    body = json.dumps({"error": inner}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})
