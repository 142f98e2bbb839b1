"""How a request can fail once admitted, and the one reading of each (`failure`): its
outcome for the metrics and the settlement, and what the client is told."""

from __future__ import annotations

from dataclasses import dataclass

from capycommon.engineclient import EngineConnectionError, IngressUnreachable
from capycommon.errors import (
    ApiNotServed,
    CacheSaltUnsupported,
    EngineError,
    EngineFailed,
    EngineUnreachable,
    InvalidRequest,
    StaleDispatch,
)

# A request the ingress never took is admitted again this often at most.
READMIT_EVERY_S = 1.0


class Undelivered(Exception):
    """The ingress never took the request: it may be admitted again."""


class NoAnswerInTime(Exception):  # within the deadline, or the stream's idle bound (`why`)
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


FAILURES = (
    EngineFailed,
    EngineError,
    EngineConnectionError,
    StaleDispatch,
    NoAnswerInTime,
    CacheSaltUnsupported,
    InvalidRequest,
    ApiNotServed,
)


@dataclass(frozen=True)
class Failure:
    """How a request that failed after its admission ends: its outcome (for the metrics and
    the settlement) and what the client is told, as an answer or as an error event."""

    outcome: str
    status: int
    code: str
    message: str
    param: str | None = None


def failure(exc: BaseException) -> Failure:
    """The one reading of every way the engine's side can fail."""
    if isinstance(exc, EngineFailed):
        return Failure(exc.code, exc.status, exc.code, exc.message, exc.param)
    if isinstance(exc, NoAnswerInTime):
        return Failure(exc.why, 503, "unavailable", f"no answer in time ({exc.why})")
    if isinstance(exc, StaleDispatch):
        return Failure(exc.code, 503, "unavailable", exc.message)
    if isinstance(exc, IngressUnreachable):
        code = EngineUnreachable.code
        return Failure(code, 503, code, str(exc))
    if isinstance(exc, CacheSaltUnsupported | InvalidRequest | ApiNotServed):  # refused unsent
        param = "cache_salt" if isinstance(exc, CacheSaltUnsupported) else None
        return Failure(exc.code, exc.http_status, exc.code, exc.message, param)
    return Failure(EngineError.code, 500, EngineError.code, f"the engine failed: {exc}")
