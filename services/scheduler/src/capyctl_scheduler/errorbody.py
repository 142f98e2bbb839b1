"""The error envelope every listener of the scheduler answers with (management, bootstrap)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from capycommon import management as wire

SAFE_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}


def error_response(status: int, code: str, message: str) -> JSONResponse:
    body = wire.ErrorBody(
        error=wire.ErrorDetail(code=code, message=message, retryable=status >= 500)
    )
    return JSONResponse(body.model_dump(mode="json"), status_code=status, headers=SAFE_HEADERS)
