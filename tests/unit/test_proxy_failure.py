"""How a request that failed after its admission ends: one reading for answers and streams."""

from __future__ import annotations

from capycommon.engineclient import EngineConnectionError
from capycommon.errors import EngineError, EngineFailed
from capyctl_router.failures import Failure, NoAnswerInTime, failure


def test_an_engines_own_error_keeps_its_status_message_and_param() -> None:
    found = failure(EngineFailed(400, "max_tokens is too large", "max_tokens"))
    assert found == Failure(
        "engine_rejected", 400, "engine_rejected", "max_tokens is too large", "max_tokens"
    )
    assert failure(EngineFailed(503, "loading")).code == "engine_error"


def test_a_cut_is_unavailable_with_its_reason_as_the_outcome() -> None:
    assert failure(NoAnswerInTime("deadline")) == Failure(
        "deadline", 503, "unavailable", "no answer in time (deadline)"
    )
    assert failure(NoAnswerInTime("stream idle")).outcome == "stream idle"


def test_a_broken_engine_or_connection_is_an_engine_error() -> None:
    for exc in (EngineError("not JSON"), EngineConnectionError("connection reset")):
        found = failure(exc)
        assert (found.outcome, found.status, found.code) == ("engine_error", 500, "engine_error")
        assert found.message.startswith("the engine failed: ")
