"""The management API on loopback, behind the admin token.

Each route parses its body into its request model, calls one `Manager` operation and answers
its model (`capycommon.management`: the bodies of every route, the error body included).
Every mutation carries an Idempotency-Key: the first answer is kept for a day, and a retry
with the same key and body gets it again without acting twice.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capycommon import httpauth, requestbody
from capycommon import management as wire
from capycommon.credentials import Credentials
from capycommon.errorcodes import http_code_for
from capycommon.errors import (
    CapyError,
    InvalidRequest,
    NotFound,
    RedisUnreachable,
)
from capycommon.service import REDIS_ERRORS, REDIS_OUTAGE
from capycommon.version import __version__
from capyctl_scheduler.enroll import Enrollment
from capyctl_scheduler.errorbody import SAFE_HEADERS, error_response
from capyctl_scheduler.idempotency import Answer, Idempotency
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.page import routes as page

MAX_BODY = 1 << 20
Body = TypeVar("Body", bound=wire.Request)
# The bodies the mutations read themselves (parsed strictly, before the Idempotency-Key).
BODIES = (
    wire.DeployRequest,
    wire.ActionRequest,
    wire.DrainRequest,
    wire.InvitationRequest,
    wire.RevokeRequest,
)
_FAILED: dict[str, Any] = {"model": wire.ErrorBody, "description": "what failed, and the fix"}


def create_app(
    credentials: Credentials, manager: Manager | None = None, enrollment: Enrollment | None = None
) -> FastAPI:
    """The scheduler's management app: the API, which only the admin token opens, and the
    status page at `/` (`page.routes`: the admin token too, by its login's cookie or the
    same header)."""

    # async: a sync dependency would cost a thread-pool hop on every request (bench/).
    async def require_admin(
        authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
    ) -> None:
        httpauth.require(authorization, credentials.admin_token, "admin token")

    app = FastAPI(
        title="CapyCTL management",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        responses={"4XX": _FAILED, "5XX": _FAILED},
    )
    admin = [Depends(require_admin)]
    api = APIRouter(dependencies=admin)
    requestbody.publish_openapi(app, f"{wire.PREFIX}/openapi.json", BODIES, admin)

    @app.exception_handler(CapyError)
    async def capy_error(_: Request, exc: CapyError) -> JSONResponse:
        return error_response(exc.http_status, exc.code, exc.message)

    async def redis_failed(_: Request, exc: Exception) -> JSONResponse:
        REDIS_OUTAGE.failed(exc)
        failed = RedisUnreachable(f"the scheduler cannot use Redis ({exc}); retry shortly")
        answer = error_response(failed.http_status, failed.code, failed.message)
        answer.headers["Retry-After"] = "1"
        return answer

    for kind in REDIS_ERRORS:
        if kind is not OSError:  # an OSError of the app's own is no outage
            app.add_exception_handler(kind, redis_failed)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = http_code_for(exc.status_code)
        return error_response(exc.status_code, code, str(exc.detail))

    @app.middleware("http")
    async def safe_headers(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers.update(SAFE_HEADERS)
        return response

    @api.get(f"{wire.PREFIX}/health")
    async def health() -> wire.Health:
        return wire.Health(status="ok", version=__version__)

    if manager is not None:
        idempotency = Idempotency(manager.scheduler.client)
        _routes(api, manager, enrollment, idempotency)
        app.include_router(api)
        page.install(app, credentials, manager, idempotency)
    else:
        app.include_router(api)
    return app


def _routes(
    app: APIRouter, manager: Manager, enrollment: Enrollment | None, idempotency: Idempotency
) -> None:

    async def mutate(
        request: Request,
        key: str | None,
        parse_as: type[Body],
        answer: type[Answer],
        act: Callable[[Body], Awaitable[Answer]],
    ) -> Answer:
        """Parse the body, then act once per Idempotency-Key (a retry gets the kept answer)."""
        body = await requestbody.read(request, MAX_BODY)
        found = requestbody.validated(parse_as, requestbody.parse_object(body or b"{}"))
        return await idempotency.once(key, request, body, answer, lambda: act(found))

    @app.post(
        f"{wire.PREFIX}/deployments",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.DeployRequest),
    )
    async def deploy(
        request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> wire.DeployAnswer:
        async def act(found: wire.DeployRequest) -> wire.DeployAnswer:
            return await manager.deploy(found.document, found.expected_revision)

        return await mutate(request, idempotency_key, wire.DeployRequest, wire.DeployAnswer, act)

    @app.post(
        f"{wire.PREFIX}/deployments/{{name}}/actions",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.ActionRequest),
    )
    async def action(
        name: str, request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> wire.ActionAnswer:
        async def act(found: wire.ActionRequest) -> wire.ActionAnswer:
            return await manager.act(name, found.action)

        return await mutate(request, idempotency_key, wire.ActionRequest, wire.ActionAnswer, act)

    @app.post(
        f"{wire.PREFIX}/hosts/{{host}}/drain",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.DrainRequest, required=False),
    )
    async def drain(
        host: str, request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> wire.DrainAnswer:
        async def act(_: wire.DrainRequest) -> wire.DrainAnswer:
            return await manager.drain(host)

        return await mutate(request, idempotency_key, wire.DrainRequest, wire.DrainAnswer, act)

    @app.post(
        f"{wire.PREFIX}/hosts/{{host}}/undrain",
        openapi_extra=requestbody.openapi_body(wire.DrainRequest, required=False),
    )
    async def undrain(
        host: str, request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> wire.UndrainAnswer:
        async def act(_: wire.DrainRequest) -> wire.UndrainAnswer:
            return await manager.undrain(host)

        return await mutate(request, idempotency_key, wire.DrainRequest, wire.UndrainAnswer, act)

    @app.get(f"{wire.PREFIX}/deployments")
    async def deployments() -> wire.DeploymentList:
        return wire.DeploymentList(deployments=await manager.summaries())

    @app.get(f"{wire.PREFIX}/deployments/{{name}}")
    async def deployment(name: str) -> wire.DeploymentStatus:
        return await manager.status(name)

    @app.get(f"{wire.PREFIX}/deployments/{{name}}/engine-log")
    async def engine_log(name: str, lines: str = "100") -> wire.EngineLog:
        return await manager.engine_log(name, _count(lines, "lines", 10_000))

    @app.get(f"{wire.PREFIX}/hosts")
    async def hosts() -> wire.HostList:
        rows = await manager.hosts()
        if enrollment is not None:
            rows = await enrollment.rows(rows)
        return wire.HostList(hosts=rows)

    def joined_hosts() -> Enrollment:
        if enrollment is None:
            raise NotFound(
                "hosts join a server role, not this one; to serve models here and on "
                "other machines, start a server with an embedded host (capyctl start server "
                "--embedded-host on) and invite hosts to it"
            )
        return enrollment

    @app.post(
        f"{wire.PREFIX}/host-invitations",
        status_code=201,
        openapi_extra=requestbody.openapi_body(wire.InvitationRequest),
    )
    async def invite(request: Request) -> wire.InvitationAnswer:
        # No Idempotency-Key: each call is a new single-use secret, and a lost answer is
        # simply asked for again.
        body = await requestbody.read(request, MAX_BODY)
        found = requestbody.validated(
            wire.InvitationRequest, requestbody.parse_object(body or b"{}")
        )
        return await joined_hosts().invite(found)

    @app.post(
        f"{wire.PREFIX}/hosts/{{host}}/revoke",
        openapi_extra=requestbody.openapi_body(wire.RevokeRequest, required=False),
    )
    async def revoke(host: str, request: Request) -> wire.RevokeAnswer:
        body = await requestbody.read(request, MAX_BODY)
        requestbody.validated(wire.RevokeRequest, requestbody.parse_object(body or b"{}"))
        return await joined_hosts().revoke(host)

    @app.get(f"{wire.PREFIX}/models")
    async def models(host: str | None = None) -> wire.ModelList:
        return wire.ModelList(models=await manager.models(host))

    @app.post(
        f"{wire.PREFIX}/models/pull",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.PullRequest),
    )
    async def pull(
        request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> wire.StoreOperationAnswer:
        return await mutate(
            request, idempotency_key, wire.PullRequest, wire.StoreOperationAnswer, manager.pull
        )

    @app.post(
        f"{wire.PREFIX}/models/remove",
        status_code=202,
        openapi_extra=requestbody.openapi_body(wire.RemoveRequest),
    )
    async def remove(
        request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> wire.StoreOperationAnswer:
        return await mutate(
            request, idempotency_key, wire.RemoveRequest, wire.StoreOperationAnswer, manager.remove
        )

    @app.get(f"{wire.PREFIX}/hosts/{{host}}/store-operations/{{operation}}")
    async def store_operation(host: str, operation: str) -> wire.StoreOperationAnswer:
        return await manager.store_operation(host, operation)

    @app.get(f"{wire.PREFIX}/engines")
    async def engines() -> wire.EngineList:
        return wire.EngineList(engines=await manager.engines())


def _count(value: str, name: str, most: int) -> int:
    """A query parameter that is a whole number from 1 to `most`; refused in the API's own
    error envelope, naming it, otherwise."""
    if not (value.isascii() and value.isdigit()) or not 1 <= int(value) <= most:
        raise InvalidRequest(f"{name} must be a whole number from 1 to {most}, not {value!r}")
    return int(value)
