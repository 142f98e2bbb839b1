"""The management API on loopback, behind the admin token."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from capycommon import httpauth
from capycommon.credentials import Credentials
from capycommon.errors import CapyError
from capycommon.version import __version__

API_VERSION = "1"
_SAFE_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def error_response(status: int, code: str, message: str) -> JSONResponse:
    body = {
        "api_version": API_VERSION,
        "error": {"code": code, "message": message, "retryable": status >= 500, "details": {}},
    }
    return JSONResponse(body, status_code=status, headers=_SAFE_HEADERS)


def create_app(credentials: Credentials) -> FastAPI:
    """The scheduler's management app. Only the admin token opens it."""

    # async: a sync dependency would cost a thread-pool hop on every request (bench/).
    async def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
        httpauth.require(authorization, credentials.admin_token, "admin token")

    app = FastAPI(
        title="CapyCTL management",
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        dependencies=[Depends(require_admin)],
    )

    @app.exception_handler(CapyError)
    async def capy_error(_: Request, exc: CapyError) -> JSONResponse:
        return error_response(exc.http_status, exc.code, exc.message)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return error_response(exc.status_code, code, str(exc.detail))

    @app.middleware("http")
    async def safe_headers(request: Request, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers.update(_SAFE_HEADERS)
        return response

    @app.get("/management/v1/health")
    async def health() -> dict[str, str]:
        return {"api_version": API_VERSION, "status": "ok", "version": __version__}

    return app
