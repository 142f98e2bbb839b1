"""The inference API: OpenAI-compatible routes behind the API key.

POST /v1/chat/completions, /v1/completions, /v1/responses, Anthropic's /v1/messages (its
key also as x-api-key, its errors in its envelope), /v1/embeddings, /v1/rerank, /v1/score,
/tokenize, /detokenize and /v1/audio/transcriptions (a multipart form) are forwarded to the
engine of the deployment that serves the request's model, where that engine serves the API
(else 400 `capability_missing:<api>`); nothing else of an engine is reachable. A
decision model's (`api: decisions`) are POST /v1/decisions, OpenAI's Decisions shape, which
the router translates to System One and back (`decisions`), and POST /v1/systemone, passed
as sent; each api's routes refuse the other's models (`wrong_api`). Each body is read and
checked whole (`capycommon.requestbody`, by its model in `bodies` or `decisions`) before the
request takes a place; GET /openapi.json describes them. Each route is declared once, in
`endpoints`. A streamed request may ask to see its model load (`CapyCTL-Progress: on`, see
`proxy`).
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
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from capycommon import httpauth, requestbody
from capycommon.credentials import Credentials
from capycommon.domain.desired import DeploymentRecord
from capycommon.engineclient import Engines
from capycommon.engines.families import ENGINE_FAMILIES
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
from capyctl_router import decisions, forms
from capyctl_router.bodies import InferenceBody
from capyctl_router.dispatch import Dispatcher
from capyctl_router.endpoints import ENDPOINTS, Endpoint, endpoints_of, serving
from capyctl_router.errors import (
    ERROR_RESPONSES,
    capy_error_handler,
    capy_error_response,
    envelope,
)
from capyctl_router.proxy import Exchange
from capyctl_router.relay import SYSTEMONE_PATH, Call, not_served
from capyctl_router.table import Table

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
    are also declared to FastAPI, for the OpenAPI document: both from `endpoints`."""

    # The inference endpoints by path, the API key and what forwards them (set by
    # create_app; none without a Router).
    proxied: dict[str, Endpoint]
    api_key: str
    inference: Router

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.proxied.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != endpoint.method:
            await super().__call__(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            httpauth.require(_credential(endpoint, request), self.api_key, "API key")
            response = await forward(self.inference, endpoint, request)
        except CapyError as exc:
            response = capy_error_response(exc, endpoint.style)
        await response(scope, receive, send)


def _credential(endpoint: Endpoint, request: Request) -> str | None:
    """The Authorization header; on Anthropic's routes, the key its clients send as
    x-api-key where they send no Authorization."""
    authorization = request.headers.get("authorization")
    if authorization is None and endpoint.style == "anthropic":
        key = request.headers.get("x-api-key")
        return None if key is None else f"Bearer {key}"
    return authorization


def create_app(credentials: Credentials, router: Router | None = None) -> FastAPI:
    """The router's ASGI app. Only the API key opens it; the admin token is refused."""

    # async: a sync dependency would cost a thread-pool hop on every request (bench/).
    async def require_api_key(authorization: Authorization = None) -> None:
        httpauth.require(authorization, credentials.api_key, "API key")

    app = requestbody.new_app(RouterApp, "CapyCTL", responses=ERROR_RESPONSES)
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
    requestbody.publish_openapi(app, "/openapi.json", [endpoint.body for endpoint in ENDPOINTS])

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
    routes (each endpoint declared to FastAPI for the OpenAPI document, and to `RouterApp`,
    which serves it before its routing). `api_key` is the dependency that requires the API
    key."""

    @app.get("/v1/models", dependencies=[api_key])
    async def list_models() -> dict[str, Any]:
        """Every route of a deployment that is not operator-stopped; it wakes nothing. A
        decision model's says so as llama.cpp does: `architecture.output_modalities`."""
        await routes_read(router.table)
        data = [
            _listed(route, record, router.table)
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
        body = await router.dispatcher.metrics.scrape(router.dispatcher.state)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    for endpoint in ENDPOINTS:
        app.add_api_route(
            endpoint.path,
            _endpoint(router, endpoint),
            methods=[endpoint.method],
            name=endpoint.name,
            summary=endpoint.summary,
            dependencies=[api_key],
            openapi_extra=requestbody.openapi_body(
                endpoint.body, files=("file",) if endpoint.form else ()
            ),
        )
        app.proxied[endpoint.path] = endpoint
    app.api_key = credentials.api_key
    app.inference = router


def _listed(route: str, record: DeploymentRecord, table: Table) -> dict[str, Any]:
    """A model as /v1/models lists it, with `endpoints`: the paths it is served on."""
    family, version = engine_of(table, record)
    listed: dict[str, Any] = {
        "id": route,
        "object": "model",
        "created": int(record.created_at),
        "owned_by": "capyctl",
        "endpoints": endpoints_of(record.document.api, family, version),
    }
    if record.document.decides:
        listed["architecture"] = {"output_modalities": ["decisions"]}
    return listed


def _same(token: str, secret: str) -> bool:
    return hmac.compare_digest(token.encode(), secret.encode())


def _endpoint(router: Router, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    async def forwarded(request: Request) -> Response:
        return await forward(router, endpoint, request)

    return forwarded


def _call(endpoint: Endpoint, body: dict[str, Any], form: forms.Form | None = None) -> Call:
    """The request as the router relays it: the body as the client sent it, once the
    endpoint's model (`bodies`, `decisions`) found nothing wrong in it (a form's text
    fields); for OpenAI's decisions, its System One translation (`decisions`)."""
    found = requestbody.validated(endpoint.body, body)
    request_id = f"{endpoint.id_prefix}-{secrets.token_hex(12)}"
    if isinstance(found, InferenceBody):
        if found.n != 1:
            raise UnsupportedParameter("n must be 1")
        return Call(
            kind=endpoint.kind,
            body=body,
            route=found.model,
            request_id=request_id,
            client_streams=found.stream,
            client_usage=found.client_usage,
            path=endpoint.path,
            answer=endpoint.answer,
            style=endpoint.style,
            form=form,
        )
    if isinstance(found, decisions.DecisionsRequest):
        return _decision_call(endpoint.kind, request_id, found)
    return Call(
        endpoint.kind,
        body,
        found.model,
        request_id,
        client_streams=False,
        client_usage=True,
        asked=found,
        path=SYSTEMONE_PATH,
    )


def _decision_call(kind: str, request_id: str, asked: decisions.DecisionsRequest) -> Call:
    """An OpenAI decisions request as the router relays it: its System One translation."""
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
        path=SYSTEMONE_PATH,
    )


def check_api(endpoint: Endpoint, model: str, record: DeploymentRecord) -> None:
    """WrongApi for a request on an endpoint of the other api than its deployment's."""
    api = record.document.api
    if endpoint.api == api:
        return
    if api == "decisions":
        raise WrongApi(
            f"model {model!r} is a decision model (api: decisions): send it "
            f"{serving(api)}, not {endpoint.path}"
        )
    raise WrongApi(
        f"model {model!r} is a chat model (api: chat): send it {serving(api)}, not "
        f"{endpoint.path}; a decision model is deployed with api: decisions"
    )


def engine_of(table: Table, record: DeploymentRecord) -> tuple[str | None, str | None]:
    """The family and version of a deployment's engine, as its instance said them; before
    it has one, the family its document names, if it names one (`engine: vllm`)."""
    instance = table.instances.get(record.name)
    if instance is not None and instance.family is not None:
        return instance.family, instance.version
    named = record.document.engine
    return (named, None) if named in ENGINE_FAMILIES else (None, None)


def _check_served(table: Table, call: Call, record: DeploymentRecord) -> None:
    """A request for an API its model's engine does not serve is refused before it waits
    for a place, where its engine is known; else when its engine is, before it is sent."""
    family, version = engine_of(table, record)
    refused = None if family is None else not_served(call.route, family, version, call)
    if refused is not None:
        raise refused


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


async def forward(router: Router, endpoint: Endpoint, request: Request) -> Response:
    """The answer to an inference request: its body read and checked here, then (`Exchange`)
    a place on its deployment's engine and the engine's answer."""
    arrived = time.monotonic()
    progress = wants_progress(request)
    raw = await requestbody.read(request, endpoint.max_body, router.body_timeout_s)
    if endpoint.form:
        form = forms.parse(request.headers.get("content-type"), raw)
        call = _call(endpoint, forms.fields_of(form), form)
    else:
        call = _call(endpoint, requestbody.parse_object(raw, unique_keys=endpoint.unique_keys))
    call.progress = progress and call.client_streams
    if not router.table.synced.is_set():
        await routes_read(router.table)
    record = router.table.deployment_of(call.route) or await _find(router.table, call, arrived)
    if record is None:
        raise UnknownModel(f"no model {call.route!r}; GET /v1/models lists them")
    check_api(endpoint, call.route, record)
    _check_served(router.table, call, record)
    _check_size(router.table, call, record)
    return Exchange(router.dispatcher, router.engines, call, record, arrived)
