"""The inference API: OpenAI-compatible routes behind the API key.

POST /v1/chat/completions, /v1/completions and /v1/embeddings are forwarded to the engine of
the deployment that serves the request's model; nothing else of an engine is reachable. A
decision model's (`api: decisions`) are POST /v1/decisions, OpenAI's Decisions shape, which
the router translates to System One and back (`decisions`), and POST /v1/systemone, passed
as sent; each api's routes refuse the other's models (`wrong_api`). Each body is read and
checked whole (`capycommon.requestbody`, by its model in `bodies` or `decisions`) before the
request takes a place; GET /openapi.json describes them. A streamed request may ask to see its
model load (`CapyCTL-Progress: on`, see `proxy`).
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request, params
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from capycommon import httpauth, requestbody
from capycommon.credentials import Credentials
from capycommon.engineclient import Engines
from capycommon.errorcodes import http_code_for
from capycommon.errors import (
    CapyError,
    InvalidRequest,
    RedisUnreachable,
    Unauthenticated,
    UnknownModel,
    UnsupportedParameter,
    WrongApi,
)
from capycommon.service import REDIS_ERRORS, wait_event
from capycommon.state.desired import DeploymentRecord
from capycommon.version import __version__
from capyctl_router import decisions
from capyctl_router.bodies import BODIES
from capyctl_router.dispatch import Dispatcher
from capyctl_router.errors import (
    ERROR_RESPONSES,
    capy_error_handler,
    capy_error_response,
    envelope,
)
from capyctl_router.proxy import Exchange
from capyctl_router.relay import DECISION_KINDS, Call
from capyctl_router.table import Table

MAX_BODY = 4 << 20
PREFIXES = {
    "chat.completions": "chatcmpl",
    "completions": "cmpl",
    "embeddings": "embd",
    "decisions": "decision",
    "systemone": "decision",
}
DECISION_BODIES: dict[str, type[BaseModel]] = {
    "decisions": decisions.DecisionsRequest,
    "systemone": decisions.SystemOneRequest,
}
# What each api's routes are, as a refusal names them.
API_ROUTES = {
    "chat": "POST /v1/chat/completions, /v1/completions or /v1/embeddings",
    "decisions": "POST /v1/decisions or /v1/systemone",
}
# The header by which a streamed request asks for comment lines while its model loads.
PROGRESS_HEADER = "CapyCTL-Progress"
# The bearer token, read by the routes themselves; the OpenAPI document names it once.
Authorization = Annotated[str | None, Header(include_in_schema=False)]


@dataclass
class Router:
    dispatcher: Dispatcher
    engines: Engines
    # The longest a request's whole body may take to arrive (the listener's body_timeout).
    body_timeout_s: float = requestbody.READ_TOTAL_S

    @property
    def table(self) -> Table:
        return self.dispatcher.table


class RouterApp(FastAPI):
    """FastAPI, with the inference routes served before its routing: a POST to one of them
    is checked and forwarded at once, without the dependency solving, routing and middleware
    every other route goes through (they cost more than the forwarding itself). The routes
    are also declared to FastAPI, for the OpenAPI document."""

    # The inference routes' paths and kinds, the API key and what forwards them (set by
    # create_app; none without a Router).
    proxied: dict[str, str]
    api_key: str
    inference: Router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = self.proxied.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            httpauth.require(request.headers.get("authorization"), self.api_key, "API key")
            response = await forward(self.inference, kind, request)
        except CapyError as exc:
            response = capy_error_response(exc)
        await response(scope, receive, send)


def create_app(credentials: Credentials, router: Router | None = None) -> FastAPI:
    """The router's ASGI app. Only the API key opens it; the admin token is refused."""

    # async: a sync dependency would cost a thread-pool hop on every request (bench/).
    async def require_api_key(authorization: Authorization = None) -> None:
        httpauth.require(authorization, credentials.api_key, "API key")

    app = RouterApp(
        title="CapyCTL",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        responses=ERROR_RESPONSES,
    )
    app.proxied = {}
    app.add_exception_handler(CapyError, capy_error_handler)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Any, exc: StarletteHTTPException) -> Any:
        code = http_code_for(exc.status_code)
        return envelope(exc.status_code, code, str(exc.detail))

    @app.get("/health", openapi_extra={"security": []})
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # Open to all, as vLLM's is: it holds no secret.
    requestbody.publish_openapi(app, "/openapi.json", [*BODIES.values(), *DECISION_BODIES.values()])

    if router is None:

        @app.get("/v1/models", dependencies=[Depends(require_api_key)])
        async def no_models() -> dict[str, Any]:
            return {"object": "list", "data": []}

        return app

    _add_router_routes(app, router, credentials, Depends(require_api_key))
    return app


def _add_router_routes(
    app: RouterApp, router: Router, credentials: Credentials, api_key: params.Depends
) -> None:
    """The routes that need the router: the models listed, the metrics, and the inference
    routes (declared to FastAPI for the OpenAPI document, and served by `RouterApp` before its
    routing). `api_key` is the dependency that requires the API key."""

    @app.get("/v1/models", dependencies=[api_key])
    async def list_models() -> dict[str, Any]:
        """Every route of a deployment that is not operator-stopped; it wakes nothing. A
        decision model's says so as llama.cpp does: `architecture.output_modalities`."""
        await routes_read(router.table)
        data = [
            _listed(route, record)
            for route, name in sorted(router.table.routes.items())
            if (record := router.table.records.get(name)) is not None and not record.stopped
        ]
        return {"object": "list", "data": data}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics(authorization: Authorization = None) -> Response:
        """Prometheus text, for the API key or the admin token."""
        token = httpauth.bearer_token(authorization) or ""
        if not any(
            _same(token, secret) for secret in (credentials.api_key, credentials.admin_token)
        ):
            raise Unauthenticated("send Authorization: Bearer <API key or admin token>")
        body = await router.dispatcher.metrics.scrape(router.dispatcher.client)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    for kind, body in [*BODIES.items(), *DECISION_BODIES.items()]:
        app.add_api_route(
            f"/v1/{kind.replace('.', '/')}",
            _endpoint(router, kind),
            methods=["POST"],
            name=kind.replace(".", "_"),
            dependencies=[api_key],
            openapi_extra=requestbody.openapi_body(body),
        )
    app.proxied = {f"/v1/{kind.replace('.', '/')}": kind for kind in [*BODIES, *DECISION_BODIES]}
    app.api_key = credentials.api_key
    app.inference = router


def _listed(route: str, record: DeploymentRecord) -> dict[str, Any]:
    listed: dict[str, Any] = {
        "id": route,
        "object": "model",
        "created": int(record.created_at),
        "owned_by": "capyctl",
    }
    if record.document.decides:
        listed["architecture"] = {"output_modalities": ["decisions"]}
    return listed


def _same(token: str, secret: str) -> bool:
    return hmac.compare_digest(token.encode(), secret.encode())


def _endpoint(router: Router, kind: str) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await forward(router, kind, request)

    return endpoint


def _call(kind: str, body: dict[str, Any]) -> Call:
    """The request as the router relays it: the body as the client sent it, once its model
    (`capyctl_router.bodies`) found nothing wrong in it."""
    if kind in DECISION_KINDS:
        return _decision_call(kind, body)
    found = requestbody.validated(BODIES[kind], body)
    if found.n != 1:
        raise UnsupportedParameter("n must be 1")
    return Call(
        kind=kind,
        body=body,
        route=found.model,
        request_id=f"{PREFIXES[kind]}-{secrets.token_hex(12)}",
        client_streams=found.stream,
        client_usage=found.client_usage,
    )


def _decision_call(kind: str, body: dict[str, Any]) -> Call:
    """A decision request as the router relays it: System One as the client sent it, or
    the System One translation of an OpenAI decisions request (`decisions`)."""
    request_id = f"{PREFIXES[kind]}-{secrets.token_hex(12)}"
    if kind == "systemone":
        one = requestbody.validated(decisions.SystemOneRequest, body)
        return Call(
            kind, body, one.model, request_id, client_streams=False, client_usage=True, asked=one
        )
    asked = requestbody.validated(decisions.DecisionsRequest, body)
    if asked.images:
        raise UnsupportedParameter(
            "input: input_image parts are not taken by decision models in this release; "
            "send the input as text"
        )
    return Call(
        kind,
        decisions.to_system_one(asked, ""),
        asked.model,
        request_id,
        client_streams=False,
        client_usage=True,
        asked=asked,
    )


def check_api(call: Call, record: DeploymentRecord) -> None:
    """WrongApi for a request on a route of the other api than its deployment's."""
    api = record.document.api
    if call.decides == record.document.decides:
        return
    path = f"/v1/{call.kind.replace('.', '/')}"
    if api == "decisions":
        raise WrongApi(
            f"model {call.route!r} is a decision model (api: decisions): send it "
            f"{API_ROUTES[api]}, not {path}"
        )
    raise WrongApi(
        f"model {call.route!r} is a chat model (api: chat): send it {API_ROUTES[api]}, not "
        f"{path}; a decision model is deployed with api: decisions"
    )


def _check_size(table: Table, call: Call, record: DeploymentRecord) -> None:
    """A decision request with more questions or options than its deployment's engine
    takes is refused before it waits for a place, where the engine's family is known (its
    instance said it); else just before it is sent."""
    instance = table.instances.get(record.name)
    if call.asked is None or instance is None or instance.family is None:
        return
    problem = decisions.over_limits(call.asked, instance.family)
    if problem is not None:
        raise InvalidRequest(f"questions: {problem}; ask fewer in one request")


# A request that comes before the worker first read its routes (just after a start) waits
# this long for them, then gets 503 redis_unreachable rather than a wrong 404.
ROUTES_WAIT_S = 5.0


async def routes_read(table: Table) -> None:
    """Return once the table has read its routes; RedisUnreachable if it cannot soon."""
    if not table.synced.is_set() and not await wait_event(table.synced, ROUTES_WAIT_S):
        raise RedisUnreachable("the router has not read its routes from Redis yet; retry shortly")


async def _find(table: Table, call: Call, arrived: float) -> DeploymentRecord | None:
    """The deployment of a route the routing table does not know, read again from Redis
    (it may have been declared a moment ago); RedisUnreachable if it cannot be read soon."""
    try:
        async with asyncio.timeout(ROUTES_WAIT_S):
            return await table.find(call.route, arrived)
    except (*REDIS_ERRORS, TimeoutError) as exc:
        reason = str(exc) or type(exc).__name__
        raise RedisUnreachable(
            f"the router cannot read its routes from Redis ({reason}); retry shortly"
        ) from None


def wants_progress(request: Request) -> bool:
    """Whether the request asks to see its model load (`CapyCTL-Progress: on`); off when the
    header is absent, refused when it is neither on nor off."""
    value = request.headers.get(PROGRESS_HEADER)
    if value is None:
        return False
    said = value.lower()
    if said not in ("on", "off"):
        raise InvalidRequest(
            f"header {PROGRESS_HEADER}: {value[:100]!r} is neither on nor off; send on (SSE "
            "comment lines while a streamed request waits for its model to load) or off"
        )
    return said == "on"


async def forward(router: Router, kind: str, request: Request) -> Response:
    """The answer to an inference request: its body read and checked here, then (`Exchange`)
    a place on its deployment's engine and the engine's answer."""
    arrived = time.monotonic()
    progress = wants_progress(request)
    raw = await requestbody.read(request, MAX_BODY, router.body_timeout_s)
    # System One's question ids are keys: one given twice would be lost, not refused.
    call = _call(kind, requestbody.parse_object(raw, unique_keys=kind == "systemone"))
    call.progress = progress and call.client_streams
    if not router.table.synced.is_set():
        await routes_read(router.table)
    record = router.table.deployment_of(call.route) or await _find(router.table, call, arrived)
    if record is None:
        raise UnknownModel(f"no model {call.route!r}; GET /v1/models lists them")
    check_api(call, record)
    _check_size(router.table, call, record)
    return Exchange(router.dispatcher, router.engines, call, record, arrived)
