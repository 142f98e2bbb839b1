"""The management API on loopback, behind the admin token.

Each route parses its body into its request model, calls one `Manager` operation and answers
its model (`capycommon.management`: the bodies of every route, the error body included). The
routes are one module per group (`routes.deployments`, `hosts`, `models`, `engines`; the status
page's are `page.routes`). Every mutation carries an Idempotency-Key: the first answer is kept
for a day, and a retry with the same key and body gets it again without acting twice.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capycommon import httpauth, requestbody
from capycommon import management as wire
from capycommon.credentials import Credentials
from capycommon.errorcodes import http_code_for
from capycommon.errors import CapyError, RedisUnreachable
from capycommon.service import REDIS_ERRORS, REDIS_OUTAGE
from capycommon.version import __version__
from capyctl_scheduler.enroll import Enrollment
from capyctl_scheduler.errorbody import SAFE_HEADERS, error_response
from capyctl_scheduler.idempotency import Idempotency
from capyctl_scheduler.manage import Manager
from capyctl_scheduler.page import routes as page
from capyctl_scheduler.routes import deployments, engines, hosts, models

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

    app = requestbody.new_app(
        FastAPI, "CapyCTL management", responses={"4XX": _FAILED, "5XX": _FAILED}
    )
    admin = [Depends(require_admin)]
    api = APIRouter(dependencies=admin)
    requestbody.publish_openapi(app, f"{wire.PREFIX}/openapi.json", BODIES, admin)
    _answer_errors(app)

    @api.get(f"{wire.PREFIX}/health")
    async def health() -> wire.Health:
        return wire.Health(status="ok", version=__version__)

    if manager is not None:
        idempotency = Idempotency(manager.scheduler.state)
        api.include_router(deployments.routes(manager, idempotency))
        api.include_router(hosts.routes(manager, idempotency, enrollment))
        api.include_router(models.routes(manager, idempotency))
        api.include_router(engines.routes(manager))
        app.include_router(api)
        page.install(app, credentials, manager, idempotency)
    else:
        app.include_router(api)
    return app


def _answer_errors(app: FastAPI) -> None:
    """Every failure answers in the error envelope: our errors by their code, a Redis outage
    as `redis_unreachable` (retry after a second), the framework's own HTTP errors by the code
    of their status; every answer carries the safe headers."""

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
