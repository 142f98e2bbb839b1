"""Errors on the inference API, in the OpenAI error envelope."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from capycommon.errors import CapyError, RequestTimeout

_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
# Refusals a prompt retry cannot change: the openai SDK does not retry an answer that says
# `x-should-retry: false` (it would otherwise retry a 409 or a 503 twice).
FINAL_CODES = frozenset({"insufficient_resources", "deployment_stopped", "deployment_inactive"})


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorEnvelope(BaseModel):
    """Every error answer's body (`error_body`), as the OpenAPI document shows it."""

    error: ErrorObject


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorEnvelope, "description": "a refusal: what is wrong, and the fix"},
    "5XX": {"model": ErrorEnvelope, "description": "a failure of the router or the engine"},
}


def error_body(status: int, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope, as an answer's body or as an error event in a stream."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def envelope(
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    extra = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return JSONResponse(
        error_body(status, code, message, param),
        status_code=status,
        headers={**extra, **(headers or {})},
    )


def retry_headers(code: str, status: int) -> dict[str, str]:
    """Whether and when a client should retry, decided here for every answer: never for a
    refusal a retry cannot change, in a second for a 429 or 503 that may pass."""
    if code.split(":", 1)[0] in FINAL_CODES:
        return {"x-should-retry": "false"}
    if status in (429, 503):
        return {"Retry-After": "1"}
    return {}


def capy_error_response(exc: CapyError) -> JSONResponse:
    headers = retry_headers(exc.code, exc.http_status)
    if exc.code == RequestTimeout.code:
        # The rest of a body sent too slowly is not waited for: the connection ends here.
        headers["Connection"] = "close"
    return envelope(exc.http_status, exc.code, exc.message, headers=headers)


async def capy_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CapyError)
    return capy_error_response(exc)
