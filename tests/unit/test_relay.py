"""The router's relay: engines' errors in every family's shape become one OpenAI envelope with
the engine's status and message; the engine's SSE lines become events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from capycommon.engineclient import Engines
from capycommon.errors import EngineError, EngineFailed
from capyctl_router.errors import error_body
from capyctl_router.relay import Events, JsonDict, engine_failure, event_failure, is_stale
from integration.router.fakeengine import engine_serving

TOO_LONG = (
    "'max_tokens' or 'max_completion_tokens' is too large: 9000. This model's maximum "
    "context length is 4096 tokens and your request has 2 input tokens (9000 > 4096 - 2)."
)


def _envelope(message: str, kind: str, code: str, param: str | None = None) -> JsonDict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _body(failure: EngineFailed) -> JsonDict:
    """The envelope the router answers the engine's error with."""
    return error_body(failure.status, failure.code, failure.message, failure.param)


@pytest.mark.parametrize(
    "body",
    [
        # vLLM from 0.10.1: nested.
        {"error": {"message": TOO_LONG, "type": "BadRequestError", "param": None, "code": 400}},
        # vLLM up to 0.10.0, and SGLang: flat.
        {
            "object": "error",
            "message": TOO_LONG,
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        },
        {"object": "error", "message": TOO_LONG, "type": "BadRequest", "param": None, "code": 400},
        # llama.cpp: nested, no param.
        {"error": {"code": 400, "message": TOO_LONG, "type": "invalid_request_error"}},
        # FastAPI's own.
        {"detail": TOO_LONG},
    ],
)
def test_an_engines_refusal_keeps_its_status_and_message(body: JsonDict) -> None:
    failure = engine_failure(400, json.dumps(body).encode())
    assert failure.http_status == 400
    assert failure.code == "engine_rejected"
    assert _body(failure) == _envelope(TOO_LONG, "invalid_request_error", "engine_rejected")


def test_an_engines_own_status_is_kept_and_its_param_too() -> None:
    body = {
        "error": {
            "message": "no such model",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    failure = engine_failure(404, json.dumps(body).encode())
    assert _body(failure) == _envelope(
        "no such model", "not_found_error", "engine_rejected", "model"
    )
    loading = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    failure = engine_failure(503, json.dumps(loading).encode())
    assert failure.http_status == 503
    assert _body(failure) == _envelope("Loading model", "server_error", "engine_error")


def test_an_engine_error_that_is_not_json_is_its_text() -> None:
    failure = engine_failure(500, b"Internal Server Error\n")
    assert _body(failure) == _envelope("Internal Server Error", "server_error", "engine_error")
    assert engine_failure(502, b"").message == "the engine answered HTTP 502"


def test_an_engine_refusing_the_routers_key_is_not_the_clients_401() -> None:
    failure = engine_failure(401, b'{"error":"Unauthorized"}')
    assert failure.http_status == 500
    assert failure.code == "engine_error"
    assert "refused the router's key (HTTP 401: Unauthorized)" in failure.message


@pytest.mark.parametrize(
    ("status", "body", "stale"),
    [
        (409, b'{"error": {"message": "m:0 moved", "type": "x", "code": "stale_dispatch"}}', True),
        (409, b'{"message": "m:0 moved", "code": "stale_dispatch"}', True),
        (409, b'{"error": {"message": "busy", "code": "lifecycle_conflict"}}', False),
        (409, b"stale_dispatch", False),
        (409, b"\xff\xfe", False),
        (400, b'{"error": {"message": "m:0 moved", "code": "stale_dispatch"}}', False),
    ],
)
def test_only_an_ingresss_409_stale_dispatch_is_stale(
    status: int, body: bytes, stale: bool
) -> None:
    """The ingress's refusal of an instance that stopped or moved; anything else an engine
    answers through it is the engine's own."""
    assert is_stale(status, body) is stale


def test_an_error_event_has_the_status_its_code_names() -> None:
    nested = {"error": {"message": TOO_LONG, "type": "BadRequestError", "param": None, "code": 400}}
    failure = event_failure(nested)
    assert failure is not None
    assert failure.http_status == 400
    assert _body(failure) == _envelope(TOO_LONG, "invalid_request_error", "engine_rejected")
    old = {
        "error": {
            "object": "error",
            "message": "boom",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    failure = event_failure(old)
    assert failure is not None
    assert (failure.http_status, failure.message) == (500, "boom")
    no_code = event_failure({"error": {"message": "odd"}})
    assert no_code is not None
    assert no_code.http_status == 500
    chunk: JsonDict = {"id": "x", "object": "chat.completion.chunk", "choices": [], "error": None}
    assert event_failure(chunk) is None


def _parse(body: bytes) -> list[JsonDict | None]:
    """The events of `body` as the router reads them from an engine on a real socket that
    sends it in pieces of 7 bytes, each its own HTTP chunk (lines and events cut anywhere);
    None for its end, `[DONE]` or not."""

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 7):
            yield body[start : start + 7]
            await asyncio.sleep(0)

    async def read() -> list[JsonDict | None]:
        async with engine_serving(lambda _: httpx.Response(200, content=pieces())) as port:
            engines = Engines()
            answer = await engines.post("127.0.0.1", port, "/v1/chat/completions", b"{}", {})
            events = Events(answer)
            found: list[JsonDict | None] = []
            try:
                while (event := await events.next(time.monotonic() + 10)) is not None:
                    found.append(event)
            finally:
                answer.close()
                engines.close()
            return [*found, None]

    return asyncio.run(read())


def test_events_are_the_data_lines_up_to_done() -> None:
    body = (
        b": ping\n\n"
        b'data: {"choices": [{"delta": {"content": "a"}}]}\n\n'
        b"event: message\n"
        b'data:{"choices": []}\n\n'
        b"data: [DONE]\n\n"
        b'data: {"after": "done"}\n\n'
    )
    assert _parse(body) == [{"choices": [{"delta": {"content": "a"}}]}, {"choices": []}, None]


def test_an_error_line_is_an_error_event() -> None:
    found = _parse(b'error: {"code": 500, "message": "slot failed", "type": "server_error"}\n\n')
    assert found == [
        {"error": {"code": 500, "message": "slot failed", "type": "server_error"}},
        None,
    ]
    assert _parse(b"error: broken\n\n") == [{"error": {"message": "broken"}}, None]


@pytest.mark.parametrize("line", [b"data: not json\n\n", b"data: [1, 2]\n\n"])
def test_an_event_that_is_not_a_json_object_is_an_engine_error(line: bytes) -> None:
    with pytest.raises(EngineError):
        _parse(line)
