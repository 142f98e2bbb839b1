"""The inference API: OpenAI-compatible routes behind the API key."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header
from starlette.exceptions import HTTPException as StarletteHTTPException

from capycommon import httpauth
from capycommon.credentials import Credentials
from capycommon.errors import CapyError
from capycommon.version import __version__
from capyctl_router.errors import capy_error_handler, envelope


def create_app(credentials: Credentials) -> FastAPI:
    """The router's ASGI app. Only the API key opens it; the admin token is refused."""

    # async: a sync dependency would cost a thread-pool hop on every request (bench/).
    async def require_api_key(authorization: Annotated[str | None, Header()] = None) -> None:
        httpauth.require(authorization, credentials.api_key, "API key")

    app = FastAPI(title="CapyCTL", version=__version__, docs_url=None, redoc_url=None)
    app.add_exception_handler(CapyError, capy_error_handler)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Any, exc: StarletteHTTPException) -> Any:
        code = "not_found" if exc.status_code == 404 else "invalid_request"
        return envelope(exc.status_code, code, str(exc.detail))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": []}

    return app
