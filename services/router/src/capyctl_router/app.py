"""The inference API: OpenAI-compatible routes behind the API key.

POST /v1/chat/completions, /v1/completions and /v1/embeddings are forwarded to the engine of
the deployment that serves the request's model; nothing else of an engine is reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

import httpx
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capycommon import httpauth
from capycommon.credentials import Credentials
from capycommon.errors import CapyError, Unauthenticated
from capycommon.version import __version__
from capyctl_router.dispatch import Dispatcher, Refused
from capyctl_router.errors import capy_error_handler, envelope
from capyctl_router.relay import (
    Assembly,
    Call,
    EngineError,
    engine_request,
    events,
    for_client,
    sse,
)
from capyctl_router.table import Table, Target

MAX_BODY = 4 << 20
REQUEST_ID_HEADER = "X-CapyCTL-Request-Id"
PREFIXES = {"chat.completions": "chatcmpl", "completions": "cmpl", "embeddings": "embd"}


@dataclass
class Router:
    dispatcher: Dispatcher
    http: httpx.AsyncClient

    @property
    def table(self) -> Table:
        return self.dispatcher.table


def create_app(credentials: Credentials, router: Router | None = None) -> FastAPI:
    """The router's ASGI app. Only the API key opens it; the admin token is refused."""

    # async: a sync dependency would cost a thread-pool hop on every request (bench/).
    async def require_api_key(authorization: Annotated[str | None, Header()] = None) -> None:
        httpauth.require(authorization, credentials.api_key, "API key")

    app = FastAPI(title="CapyCTL", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.add_exception_handler(CapyError, capy_error_handler)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Any, exc: StarletteHTTPException) -> Any:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code,
                                                                  "invalid_request")  # fmt: skip
        return envelope(exc.status_code, code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    if router is None:

        @app.get("/v1/models", dependencies=[Depends(require_api_key)])
        async def no_models() -> dict[str, Any]:
            return {"object": "list", "data": []}

        return app

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models() -> dict[str, Any]:
        """Every route of a deployment that is not operator-stopped; it wakes nothing."""
        data = [
            {"id": route, "object": "model", "created": int(record.created_at),
             "owned_by": "capyctl"}
            for route, name in sorted(router.table.routes.items())
            if (record := router.table.records.get(name)) is not None and not record.stopped
        ]  # fmt: skip
        return {"object": "list", "data": data}

    @app.get("/metrics")
    async def metrics(authorization: Annotated[str | None, Header()] = None) -> Response:
        """Prometheus text, for the API key or the admin token."""
        token = httpauth.bearer_token(authorization) or ""
        if not any(_same(token, secret) for secret in (credentials.api_key,
                                                        credentials.admin_token)):  # fmt: skip
            raise Unauthenticated("send Authorization: Bearer <API key or admin token>")
        body = router.dispatcher.metrics.render()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    for kind in PREFIXES:
        app.add_api_route(
            f"/v1/{kind.replace('.', '/')}",
            _endpoint(router, kind),
            methods=["POST"],
            dependencies=[Depends(require_api_key)],
        )
    return app


def _same(token: str, secret: str) -> bool:
    return hmac.compare_digest(token.encode(), secret.encode())


def _endpoint(router: Router, kind: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await forward(router, kind, request)

    return endpoint


async def _body(request: Request) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise CapyError(f"the body is over {MAX_BODY >> 20} MiB", code="body_too_large")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY:
            raise CapyError(f"the body is over {MAX_BODY >> 20} MiB", code="body_too_large")
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CapyError(f"the body is not JSON: {exc}", code="invalid_request") from None
    if not isinstance(body, dict):
        raise CapyError("the body must be a JSON object", code="invalid_request")
    return body


def _call(kind: str, body: dict[str, Any]) -> Call:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise CapyError("model is required: the id of a model (GET /v1/models lists them)",
                        code="invalid_request")  # fmt: skip
    stream = body.get("stream", False)
    if not isinstance(stream, bool) or (kind == "embeddings" and stream):
        raise CapyError("stream must be true or false (embeddings are never streamed)",
                        code="invalid_request")  # fmt: skip
    if body.get("n", 1) != 1:
        raise CapyError("n must be 1", code="unsupported_parameter")
    options = body.get("stream_options") or {}
    usage = bool(options.get("include_usage")) if isinstance(options, dict) else False
    return Call(kind=kind, body=body, route=model,
                request_id=f"{PREFIXES[kind]}-{secrets.token_hex(12)}",
                client_streams=stream, client_usage=usage or not stream)  # fmt: skip


async def forward(router: Router, kind: str, request: Request) -> Response:
    arrived = time.monotonic()
    call = _call(kind, await _body(request))
    record = router.table.deployment_of(call.route)
    if record is None:
        raise CapyError(f"no model {call.route!r}; GET /v1/models lists them",
                        code="unknown_model")  # fmt: skip
    name = record.name
    dispatcher = router.dispatcher
    deadline = arrived + dispatcher.deadline_of(name)
    headers = {REQUEST_ID_HEADER: call.request_id}
    try:
        target = await _until_disconnect(request, dispatcher, dispatcher.acquire(name, deadline))
    except Refused as exc:
        dispatcher.metrics.outcome(name, exc.code)
        retry = {"Retry-After": "1"} if exc.code in ("queue_full", "unavailable") else {}
        return envelope(exc.http_status, exc.code, exc.message, headers={**headers, **retry})
    if target is None:
        dispatcher.metrics.outcome(name, "client_gone")
        return Response(status_code=499)
    dispatcher.metrics.running.labels(name).inc()
    session = Session(router, call, target, arrived, deadline)
    if call.client_streams:
        return StreamingResponse(session.stream(), media_type="text/event-stream",
                                 headers=headers)  # fmt: skip
    return await session.collect(request, headers)


async def _until_disconnect(
    request: Request, dispatcher: Dispatcher, work: Awaitable[Target]
) -> Target | None:
    """`work`'s result, or None (after cancelling it) if the client hangs up first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, CapyError):
        target = await task
        await dispatcher.release(target)  # a place taken just as the client left
    return None


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Session:
    """One admitted request: relayed, then its place settled."""

    router: Router
    call: Call
    target: Target
    arrived: float
    deadline: float

    async def _open(self) -> httpx.Response:
        body, headers = engine_request(self.call, self.target)
        url = f"http://127.0.0.1:{self.target.port}{self.call.path}"
        request = self.router.http.build_request("POST", url, json=body, headers=headers)
        response = await self.router.http.send(request, stream=True)
        if response.status_code >= 400:
            text = (await response.aread()).decode(errors="replace")[:2000]
            await response.aclose()
            raise EngineRejected(response.status_code, text)
        return response

    def _first_output(self) -> None:
        if not self.call.answered:
            self.call.answered = True
            self.router.dispatcher.metrics.first_output(
                self.target.deployment, time.monotonic() - self.arrived
            )

    async def _events(self, response: httpx.Response) -> AsyncIterator[dict[str, Any] | None]:
        """The engine's events, bounded by the deadline until the first, then by the idle
        bound between events."""
        iterator = events(response).__aiter__()
        limits = self.router.dispatcher.limits
        while True:
            wait = (self.deadline - time.monotonic()) if not self.call.answered else (
                limits.stream_idle_s)  # fmt: skip
            try:
                event = await asyncio.wait_for(iterator.__anext__(), max(0.001, wait))
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise Cut("deadline" if not self.call.answered else "stream idle") from None
            self._first_output()
            yield event
            if event is None:
                return

    async def stream(self) -> AsyncIterator[bytes]:
        outcome = "cancelled"
        response: httpx.Response | None = None
        try:
            response = await self._open()
            async for event in self._events(response):
                shown = for_client(self.call, event) if event is not None else None
                if event is None or shown is not None:
                    yield sse(shown)
            outcome = "ok"
        except EngineRejected as exc:
            outcome = "engine_rejected"
            yield sse(exc.event())
        except (EngineError, httpx.HTTPError) as exc:
            outcome = "engine_error"
            yield sse({"error": {"message": str(exc), "type": "server_error",
                                 "code": "engine_error"}})  # fmt: skip
        except Cut as exc:
            outcome = exc.why
            yield sse({"error": {"message": f"cut: {exc.why}", "type": "server_error",
                                 "code": "unavailable"}})  # fmt: skip
        finally:
            await _settled(self._finish(response, outcome))

    async def collect(self, request: Request, headers: dict[str, str]) -> Response:
        outcome = "cancelled"
        response: httpx.Response | None = None

        async def assemble() -> dict[str, Any]:
            nonlocal response
            response = await self._open()
            if self.call.kind == "embeddings":
                body: dict[str, Any] = json.loads(await response.aread())
                self._first_output()
                return {**body, "model": self.call.route}
            assembly = Assembly(self.call)
            async for event in self._events(response):
                if event is not None:
                    assembly.add(event)
            return assembly.body()

        try:
            task = asyncio.ensure_future(assemble())
            gone = asyncio.ensure_future(_disconnected(request))
            done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if task not in done:
                task.cancel()  # closes the engine connection at once
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                return Response(status_code=499)
            body = task.result()
            outcome = "ok"
            return JSONResponse(body, headers=headers)
        except EngineRejected as exc:
            outcome = "engine_rejected"
            return JSONResponse(exc.event(), status_code=exc.status, headers=headers)
        except (EngineError, httpx.HTTPError) as exc:
            outcome = "engine_error"
            return envelope(500, "engine_error", f"the engine failed: {exc}", headers=headers)
        except Cut as exc:
            outcome = exc.why
            return envelope(503, "unavailable", f"no answer in time ({exc.why})",
                            headers={**headers, "Retry-After": "1"})  # fmt: skip
        finally:
            await _settled(self._finish(response, outcome))

    async def _finish(self, response: httpx.Response | None, outcome: str) -> None:
        """Close the engine connection (at once, if the client left), then settle the place."""
        if response is not None:
            await response.aclose()
        dispatcher = self.router.dispatcher
        dispatcher.metrics.running.labels(self.target.deployment).dec()
        dispatcher.metrics.outcome(self.target.deployment, outcome)
        if outcome in ("ok", "engine_rejected", "engine_error"):
            await dispatcher.release(self.target)
        else:
            await dispatcher.cut(self.target, self.call.request_id, self.call.answered)


_settling: set[asyncio.Task[None]] = set()


async def _settled(work: Coroutine[Any, Any, None]) -> None:
    """Run a request's settlement to its end even when the request's task is being
    cancelled (a client hang-up cancels the stream that is settling)."""
    task = asyncio.ensure_future(work)
    _settling.add(task)
    task.add_done_callback(_settling.discard)
    await asyncio.shield(task)


class Cut(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class EngineRejected(Exception):
    """The engine refused the request (its own 4xx): relayed as it said it."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text

    def event(self) -> dict[str, Any]:
        try:
            found = json.loads(self.text)
        except json.JSONDecodeError:
            found = None
        if isinstance(found, dict) and "error" in found:
            return found
        return {"error": {"message": self.text, "type": "invalid_request_error",
                          "code": "engine_rejected"}}  # fmt: skip
