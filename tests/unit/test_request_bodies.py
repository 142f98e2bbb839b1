"""Request bodies read strictly: each hostile kind is a 400 invalid_request that names what
is wrong and where; what any JSON writer can write again passes as sent; a body that stops
coming is a 400 after a short wait, one too large a 413."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fastapi import FastAPI
from starlette.requests import Request
from starlette.types import Message

from capycommon import management as wire
from capycommon import requestbody
from capycommon.errors import BodyTooLarge, CapyError, InvalidRequest, RequestTimeout
from capyctl_router.bodies import ChatBody, CompletionBody, EmbeddingBody
from capyctl_router.endpoints import ENDPOINTS
from hostile import KINDS


def _refused(body: bytes, model: type[Any] = ChatBody) -> CapyError:
    with pytest.raises(InvalidRequest) as refused:
        requestbody.validated(model, requestbody.parse_object(body))
    return refused.value


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_hostile_kind_is_a_400_naming_it(name: str) -> None:
    body, says = KINDS[name]
    refused = _refused(body)
    assert (refused.http_status, refused.code) == (400, "invalid_request")
    assert says in refused.message
    refused.message.encode("utf-8")  # the answer can carry it: no surrogate of the body in it


def test_what_any_writer_can_write_again_passes_as_sent() -> None:
    text = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "caf\u00e9 \U0001f600 \x00"}],
            "seed": -(10**99),
            "temperature": 1.7976931348623157e308,
            "deep": json.loads("[" * 63 + "]" * 63),
            "vllm_field": {"anything": [None, True]},
        }
    )
    found = requestbody.parse_object(text.encode())
    assert found == json.loads(text)
    assert requestbody.validated(ChatBody, found).model_extra == {
        key: found[key] for key in ("seed", "temperature", "deep", "vllm_field")
    }


def test_an_escaped_surrogate_pair_is_one_character() -> None:
    found = requestbody.parse_object(b'{"content": "\\ud83d\\ude00"}')
    assert found == {"content": "\U0001f600"}


@pytest.mark.parametrize(
    ("model", "fields", "says"),
    [
        (CompletionBody, {"prompt": 3}, "prompt: Input should be a valid string; prompt takes"),
        (EmbeddingBody, {"stream": True}, "stream: embeddings are never streamed; send false"),
        (ChatBody, {"model": ""}, "model: String should have at least 1 character; model takes"),
        (ChatBody, {"messages": [1]}, "messages[0]: should be a JSON object"),
    ],
    ids=["union-once", "own-words", "empty-model", "message-not-object"],
)
def test_a_wrong_field_is_named_with_what_it_takes(
    model: type[Any], fields: dict[str, Any], says: str
) -> None:
    body = {"model": "m", "messages": [], **fields}
    refused = _refused(json.dumps(body).encode(), model)
    assert refused.message.count(";") <= 2, refused.message
    assert says in refused.message


def test_every_wrong_field_is_named_at_once() -> None:
    refused = _refused(b'{"stream": 1, "stream_options": []}')
    assert refused.message.split("; ")[0::2] == [
        "model is required",
        "stream: Input should be a valid boolean",
        "stream_options: should be a JSON object",
        "messages is required",
    ]


def test_a_forbidden_field_is_named() -> None:
    refused = _refused(b'{"action": "stop", "force": true}', wire.ActionRequest)
    assert refused.message == "unknown field 'force'; remove it or correct its spelling"


def test_the_bounds_are_exact() -> None:
    depth = requestbody.MAX_DEPTH
    requestbody.parse_object(b'{"x": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}")
    with pytest.raises(InvalidRequest, match=f"deeper than {depth}"):
        requestbody.parse_object(b'{"x": ' + b"[" * depth + b"]" * depth + b"}")
    digits = requestbody.MAX_DIGITS
    assert requestbody.parse_object(b'{"x": -' + b"9" * digits + b"}")["x"] == -(10**digits - 1)
    with pytest.raises(InvalidRequest, match=f"x: an integer of {digits + 1} digits"):
        requestbody.parse_object(b'{"x": ' + b"9" * (digits + 1) + b"}")


# Reading --------------------------------------------------------------------------------


def _request(headers: dict[str, str], parts: list[bytes], then: str) -> Request:
    """A request whose body comes in `parts`, then `then`: the end, or nothing more (a client
    that stopped sending)."""
    messages: list[Message] = [
        {"type": "http.request", "body": part, "more_body": True} for part in parts
    ]

    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        if then == "stall":
            await asyncio.Event().wait()
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }
    return Request(scope, receive)


def _read(request: Request, limit: int = 1 << 20) -> bytes:
    return asyncio.run(requestbody.read(request, limit))


def test_a_body_in_parts_is_read_whole() -> None:
    assert _read(_request({}, [b'{"a":', b" 1}"], "end")) == b'{"a": 1}'


def test_a_body_shorter_than_its_length_is_a_400_after_the_idle_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(requestbody, "READ_IDLE_S", 0.05)
    with pytest.raises(InvalidRequest) as refused:
        _read(_request({"Content-Length": "100"}, [b'{"model": ', b'"m"'], "stall"))
    assert (refused.value.http_status, refused.value.code) == (400, "invalid_request")
    assert "stopped after 13 bytes of the 100 its Content-Length announced" in refused.value.message


@pytest.mark.parametrize(
    ("headers", "parts"),
    [({"Content-Length": str(2 << 20)}, []), ({}, [b"x" * (1 << 19)] * 3)],
    ids=["announced", "sent"],
)
def test_a_body_over_the_limit_is_a_413(headers: dict[str, str], parts: list[bytes]) -> None:
    with pytest.raises(BodyTooLarge) as refused:
        _read(_request(headers, parts, "end"))
    assert (refused.value.http_status, refused.value.message) == (413, "the body is over 1 MiB")


# Describing -----------------------------------------------------------------------------


def test_the_openapi_document_describes_the_bodies_and_the_token() -> None:
    app = FastAPI(title="t", version="1")
    chat = [endpoint for endpoint in ENDPOINTS if endpoint.api == "chat"]
    for endpoint in chat:
        extra = requestbody.openapi_body(endpoint.body)
        app.add_api_route(endpoint.path, _nothing, methods=["POST"], openapi_extra=extra)
    document = requestbody.openapi_document(app, [endpoint.body for endpoint in chat])
    schemas = document["components"]["schemas"]
    assert {"ChatBody", "CompletionBody", "EmbeddingBody", "StreamOptions"} <= set(schemas)
    options = schemas["ChatBody"]["properties"]["stream_options"]["anyOf"][0]
    assert options == {"$ref": "#/components/schemas/StreamOptions"}
    operation = document["paths"]["/v1/chat/completions"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatBody"
    }
    assert document["security"] == [{"bearer": []}]
    assert document["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


async def _nothing() -> None:
    return None


def test_a_body_trickled_past_its_whole_bound_is_a_408() -> None:
    """Each part within the idle bound, the whole past `total_s`."""
    parts = [b"{"] + [b" "] * 1000

    async def slow() -> Message:
        await asyncio.sleep(0.01)  # the client's pace
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"", "headers": []}
    with pytest.raises(RequestTimeout) as refused:
        asyncio.run(requestbody.read(Request(scope, slow), 1 << 20, total_s=0.2))
    assert (refused.value.http_status, refused.value.code) == (408, "request_timeout")
    assert "the body took longer than 0.2 s to arrive" in refused.value.message
