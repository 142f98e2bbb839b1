"""The management API on loopback, behind the admin token.

Every mutation carries an Idempotency-Key: the first answer is kept for a day, and a retry
with the same key and body gets it again without acting twice.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

import redis.asyncio as aioredis
from fastapi import Depends, FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from capycommon import httpauth, keys
from capycommon.credentials import Credentials
from capycommon.errors import CapyError
from capycommon.version import __version__
from capyctl_scheduler.manage import Manager

API_VERSION = "1"
_SAFE_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def error_response(status: int, code: str, message: str) -> JSONResponse:
    body = {
        "api_version": API_VERSION,
        "error": {"code": code, "message": message, "retryable": status >= 500, "details": {}},
    }
    return JSONResponse(body, status_code=status, headers=_SAFE_HEADERS)


IDEMPOTENCY_TTL_S = 86_400
MAX_BODY = 1 << 20


class DeployBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    document: dict[str, Any]
    expected_revision: int | None = None


class ActionBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Literal["start", "park", "stop", "delete"]


class IdempotencyConflict(CapyError):
    code = "idempotency_conflict"


class InvalidRequest(CapyError):
    code = "invalid_request"


class Idempotency:
    """Replays the recorded answer of a mutation retried with the same key."""

    def __init__(self, client: aioredis.Redis) -> None:
        self.client = client

    async def begin(self, key: str | None, request: Request, body: bytes) -> dict[str, Any] | None:
        """The recorded answer, or None after claiming the key for this request."""
        if not key or len(key) > 200:
            raise InvalidRequest(
                "a mutation needs an Idempotency-Key header (up to 200 characters), e.g. a "
                "fresh UUID per command; a retry sends the same key"
            )
        digest = hashlib.sha256(request.method.encode() + request.url.path.encode() + body)
        claim = json.dumps({"digest": digest.hexdigest(), "answer": None})
        if await self.client.set(keys.idempotency(key), claim, nx=True, ex=IDEMPOTENCY_TTL_S):
            return None
        raw = await self.client.get(keys.idempotency(key))
        found = json.loads(raw) if raw else {"digest": None, "answer": None}
        if found["digest"] != digest.hexdigest():
            raise IdempotencyConflict(
                "this Idempotency-Key was used for a different request; use a new key"
            )
        if found["answer"] is None:
            raise IdempotencyConflict("a request with this Idempotency-Key is still running")
        answer: dict[str, Any] = found["answer"]
        return answer

    async def finish(self, key: str, request: Request, body: bytes, answer: dict[str, Any]) -> None:
        digest = hashlib.sha256(request.method.encode() + request.url.path.encode() + body)
        record = json.dumps({"digest": digest.hexdigest(), "answer": answer})
        await self.client.set(keys.idempotency(key), record, ex=IDEMPOTENCY_TTL_S)

    async def abandon(self, key: str) -> None:
        await self.client.delete(keys.idempotency(key))


def create_app(credentials: Credentials, manager: Manager | None = None) -> FastAPI:
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

    if manager is not None:
        _routes(app, manager)
    return app


def _routes(app: FastAPI, manager: Manager) -> None:
    idempotency = Idempotency(manager.scheduler.client)

    async def mutate(request: Request, key: str | None, act: Any) -> JSONResponse:
        body = await request.body()
        if len(body) > MAX_BODY:
            return error_response(413, "body_too_large", "the body is over 1 MiB")
        replay = await idempotency.begin(key, request, body)
        if replay is not None:
            return JSONResponse(replay, status_code=202)
        assert key is not None
        try:
            answer = {"api_version": API_VERSION, **await act(body)}
        except BaseException:
            await idempotency.abandon(key)
            raise
        await idempotency.finish(key, request, body, answer)
        return JSONResponse(answer, status_code=202)

    def parse(model: type[BaseModel], body: bytes) -> Any:
        try:
            return model.model_validate_json(body)
        except ValueError as exc:
            raise InvalidRequest(f"the request body is not valid: {exc}") from None

    @app.post("/management/v1/deployments")
    async def deploy(
        request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> JSONResponse:
        async def act(body: bytes) -> dict[str, Any]:
            found = parse(DeployBody, body)
            return await manager.deploy(found.document, found.expected_revision)

        return await mutate(request, idempotency_key, act)

    @app.post("/management/v1/deployments/{name}/actions")
    async def action(
        name: str, request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> JSONResponse:
        async def act(body: bytes) -> dict[str, Any]:
            return await manager.act(name, parse(ActionBody, body).action)

        return await mutate(request, idempotency_key, act)

    @app.post("/management/v1/hosts/{host}/drain")
    async def drain(
        host: str, request: Request, idempotency_key: Annotated[str | None, Header()] = None
    ) -> JSONResponse:
        async def act(body: bytes) -> dict[str, Any]:
            return await manager.drain(host)

        return await mutate(request, idempotency_key, act)

    @app.get("/management/v1/deployments")
    async def deployments() -> dict[str, Any]:
        return {"api_version": API_VERSION, "deployments": await manager.summaries()}

    @app.get("/management/v1/deployments/{name}")
    async def deployment(name: str) -> dict[str, Any]:
        return {"api_version": API_VERSION, **await manager.status(name)}

    @app.get("/management/v1/hosts")
    async def hosts() -> dict[str, Any]:
        return {"api_version": API_VERSION, "hosts": await manager.hosts()}

    @app.get("/management/v1/engines")
    async def engines() -> dict[str, Any]:
        return {"api_version": API_VERSION, "engines": await manager.engines()}
