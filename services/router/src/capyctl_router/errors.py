"""Errors on the inference API, in the envelope of the API the client speaks: OpenAI's
(`{"error": {"message", "type", "param", "code"}}`) or, on Anthropic's Messages routes,
Anthropic's (`{"type": "error", "error": {"type", "message"}}`, with CapyCTL's stable `code`
beside them). Both carry the same status and the same code."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from capycommon.errors import CapyError, RequestTimeout

_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
# Anthropic's error types by status (its documented errors); another 4xx is an invalid request,
# another 5xx an api_error.
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
# Whose envelope an endpoint's errors come in.
Envelope = Literal["openai", "anthropic"]
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


def error_body(
    status: int,
    code: str,
    message: str,
    param: str | None = None,
    style: Envelope = "openai",
) -> dict[str, Any]:
    """The error envelope of `style`, as an answer's body or (OpenAI's chat and
    completions, Anthropic's messages) as an error event in a stream."""
    if style == "anthropic":
        kind = _ANTHROPIC_TYPES.get(
            status, "invalid_request_error" if status < 500 else "api_error"
        )
        return {"type": "error", "error": {"type": kind, "message": message, "code": code}}
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def envelope(
    status: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
    style: Envelope = "openai",
) -> JSONResponse:
    extra = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    return JSONResponse(
        error_body(status, code, message, param, style),
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


def capy_error_response(exc: CapyError, style: Envelope = "openai") -> JSONResponse:
    headers = retry_headers(exc.code, exc.http_status)
    if exc.code == RequestTimeout.code:
        # The rest of a body sent too slowly is not waited for: the connection ends here.
        headers["Connection"] = "close"
    return envelope(exc.http_status, exc.code, exc.message, headers=headers, style=style)


async def capy_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CapyError)
    return capy_error_response(exc)
