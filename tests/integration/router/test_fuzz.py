"""The inference API under fuzzing: the real app in process over a real redis-server, one ready
deployment on a fake engine. Schemathesis draws requests from the API's own OpenAPI document
(valid ones and ones that break it); a hypothesis strategy draws hostile JSON for the proxy
routes. Whatever comes in: no 5xx, every refusal in the OpenAI envelope, no place kept after,
no traceback logged."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from schemathesis import Case

from capycommon import requestbody
from capycommon.credentials import generate
from capycommon.engineclient import Engines
from capycommon.state.stores import State
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table
from hostile import (
    BODIES,
    CHAT_FIELDS,
    KINDS,
    MODEL,
    fuzzing,
    openapi_cases,
    send,
)
from integration.router.fakeengine import engine_serving
from integration.router.ready import put_ready

CREDENTIALS = generate()
AUTH = {"Authorization": f"Bearer {CREDENTIALS.api_key}"}
HOST = "local"
ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
# The other JSON routes, each answered by the fake engine in its API's shape.
MORE_ROUTES = ["/v1/responses", "/v1/rerank", "/v1/score", "/tokenize", "/detokenize"]
ANTHROPIC_ROUTES = ["/v1/messages", "/v1/messages/count_tokens"]
FORM_ROUTE = "/v1/audio/transcriptions"
DECISION_ROUTES = ["/v1/decisions", "/v1/systemone"]
# A decision model on the same engine.
JUDGE = "judge"
FUZZ = fuzzing(150)
CHUNK = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
EMBEDDINGS = (
    b'{"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}]}'
)


@dataclass
class Served:
    """The router in front of a fake engine that checks what it gets is JSON anyone reads."""

    http: httpx.AsyncClient
    state: State
    metrics: Metrics
    sent: list[bytes] = field(default_factory=list)
    embeddings: bytes = EMBEDDINGS

    def engine(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request.content)
        path = request.url.path
        if path == FORM_ROUTE:
            assert request.headers["content-type"].startswith("multipart/form-data; boundary=")
            return httpx.Response(200, json={"text": "hi"})
        body = json.loads(request.content)  # what the router sends parses anywhere
        if path == "/v1/embeddings":
            return httpx.Response(200, content=self.embeddings)
        if path == "/v1/systemone":
            return httpx.Response(200, json=_decided(body))
        if path in ("/v1/responses", "/v1/messages"):
            return httpx.Response(200, content=_typed_events(path))
        if path in MORE_ROUTES or path in ANTHROPIC_ROUTES:
            return httpx.Response(200, json={"model": body["model"], "input_tokens": 1})
        events = f"data: {json.dumps(CHUNK)}\n\ndata: [DONE]\n\n"
        return httpx.Response(200, content=events.encode())

    async def post(self, path: str, body: bytes) -> httpx.Response:
        headers = {**AUTH, "Content-Type": "application/json"}
        return await self.http.post(path, content=body, headers=headers)

    async def assert_no_place_kept(self) -> None:
        assert (await self.state.places.get(MODEL)).running == 0
        assert (await self.state.places.get(JUDGE)).running == 0
        running = self.metrics.registry.get_sample_value(
            "capyctl_requests_running", {"deployment": MODEL}
        )
        assert running in (None, 0.0)


@pytest.fixture
async def served(redis_socket: Path, caplog: pytest.LogCaptureFixture) -> AsyncIterator[Served]:
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    metrics = Metrics()
    served = Served(httpx.AsyncClient(), state, metrics)
    engines = Engines()
    async with engine_serving(served.engine) as port:
        await put_ready(state.client, MODEL, host=HOST, port=port)
        await put_ready(state.client, JUDGE, "sglang", host=HOST, port=port, api="decisions")
        table = Table(state, {HOST})
        await table.sync()
        app = create_app(CREDENTIALS, Router(Dispatcher(state, table, metrics), engines))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        caplog.set_level(logging.INFO)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            served.http = http
            yield served
        await served.assert_no_place_kept()
    engines.close()
    await state.client.aclose()
    tracebacks = [
        r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR
    ]
    assert tracebacks == []


def _typed_events(path: str) -> bytes:
    """A short answer in the typed events of Responses or Messages."""
    if path == "/v1/responses":
        response = {"id": "resp_1", "object": "response", "status": "completed", "output": []}
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": {**response, "status": "in_progress"}},
            {"type": "response.completed", "response": response},
        ]
    else:
        message = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
        events = [
            {"type": "message_start", "message": {**message, "usage": {"input_tokens": 1}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text"}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {}},
            {"type": "message_stop"},
        ]
    return b"".join(
        f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode() for event in events
    )


def _decided(body: dict[str, Any]) -> dict[str, Any]:
    """A System One answer to every question asked: the first option, or level, at 0.75."""
    answers: dict[str, Any] = {}
    for qid, question in body["questions"].items():
        criteria = question.get("criteria")
        if question["type"] == "noul":
            answers[qid] = {"type": "noul", "noul": 0.75}
            continue
        keys = (
            list(criteria)
            if question["type"] == "choice"
            else [str(i) for i in range(len(criteria))]
        )
        rest = 0.25 / (len(keys) - 1)
        probabilities = {key: 0.75 if i == 0 else rest for i, key in enumerate(keys)}
        answers[qid] = {"type": question["type"], "probabilities": probabilities}
        if question["type"] == "choice":
            answers[qid]["choice"] = keys[0]
        else:
            answers[qid]["score"] = sum(i * p for i, p in enumerate(probabilities.values()))
    return {"model": body["model"], "answers": answers, "usage": {"input_tokens": 9}}


def _refusal(response: httpx.Response) -> dict[str, Any]:
    """The error object of a 4xx answer: Anthropic's on its routes, else OpenAI's."""
    assert 400 <= response.status_code < 500, response.text
    found = response.json()
    error: dict[str, Any] = found["error"]
    if response.request.url.path in ANTHROPIC_ROUTES:
        assert found["type"] == "error"
        assert set(error) == {"message", "type", "code"}
    else:
        assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.anyio
async def test_each_hostile_kind_is_a_400_naming_it_before_admission(served: Served) -> None:
    for name, (body, says) in KINDS.items():
        error = _refusal(await served.post(ROUTES[0], body))
        assert (error["code"], error["type"]) == ("invalid_request", "invalid_request_error")
        assert says in error["message"], name
        for path in ROUTES[1:] if name not in CHAT_FIELDS else ():
            assert _refusal(await served.post(path, body))["code"] == "invalid_request", name
    assert served.sent == [], "nothing reached the engine"


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("path", "fields", "code", "says"),
    [
        (ROUTES[0], {"n": 2}, "unsupported_parameter", "n must be 1"),
        (ROUTES[0], {"messages": None}, "invalid_request", "messages: should be a JSON array"),
        (ROUTES[1], {"prompt": 3}, "invalid_request", "prompt: Input should be a valid string"),
        (ROUTES[2], {"stream": True}, "invalid_request", "embeddings are never streamed"),
        (ROUTES[2], {"input": {"text": "hi"}}, "invalid_request", "input takes a text"),
    ],
    ids=["n", "messages-null", "prompt-number", "embeddings-streamed", "input-object"],
)
async def test_a_wrong_field_is_named(
    served: Served, path: str, fields: dict[str, Any], code: str, says: str
) -> None:
    body = {"model": MODEL, "messages": [], "prompt": "hi", "input": "hi", **fields}
    error = _refusal(await served.post(path, json.dumps(body).encode()))
    assert (error["code"], error["type"]) == (code, "invalid_request_error")
    assert says in error["message"]


@pytest.mark.anyio
async def test_what_the_router_does_not_read_reaches_the_engine_as_sent(served: Served) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "caf\u00e9 \U0001f600"}],
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "seed": 10**99,
        "temperature": 1e-300,
        "nested": json.loads("[" * 60 + "]" * 60),
    }
    response = await served.post(ROUTES[0], json.dumps(body).encode())
    assert response.status_code == 200, response.text
    sent = json.loads(served.sent[-1])
    assert {key: sent[key] for key in body if key != "model"} == {
        key: value for key, value in body.items() if key != "model"
    }


@pytest.mark.anyio
async def test_embeddings_that_are_not_json_are_the_engines_failure(served: Served) -> None:
    served.embeddings = b"\xff not JSON"
    response = await served.post(ROUTES[2], b'{"model": "m", "input": "hi"}')
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "engine_error"


async def _answered_without_5xx(served: Served, path: str, body: bytes) -> None:
    """`body` posted to `path` is answered below 500, a refusal in the one error shape, and
    no place is left taken."""
    response = await served.post(path, body)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        _refusal(response)
    await served.assert_no_place_kept()


@pytest.mark.anyio
@FUZZ
@given(path=st.sampled_from(ROUTES + MORE_ROUTES + ANTHROPIC_ROUTES), body=BODIES)
async def test_hostile_json_is_never_a_5xx(served: Served, path: str, body: bytes) -> None:
    await _answered_without_5xx(served, path, body)


@pytest.mark.anyio
@FUZZ
@given(path=st.sampled_from(DECISION_ROUTES), body=BODIES)
async def test_hostile_json_to_a_decision_model_is_never_a_5xx(
    served: Served, path: str, body: bytes
) -> None:
    try:
        found = json.loads(body)
    except ValueError:
        found = None
    if isinstance(found, dict):  # the decision model, so a valid request is admitted
        body = json.dumps({**found, "model": JUDGE}).encode()
    await _answered_without_5xx(served, path, body)


@pytest.mark.anyio
async def test_both_decision_formats_reach_the_engine_as_system_one(served: Served) -> None:
    asked = {
        "model": JUDGE,
        "input": "a ticket",
        "questions": [
            {"type": "predicate", "instructions": "A bug?"},
            {
                "type": "choice",
                "name": "t",
                "instructions": "Team?",
                "choices": [{"value": True}, {"value": "web"}],
            },
        ],
    }
    response = await served.post(DECISION_ROUTES[0], json.dumps(asked).encode())
    assert response.status_code == 200, response.text
    assert [a["type"] for a in response.json()["answers"]] == ["predicate", "choice"]
    assert response.json()["answers"][1]["choice"] is True
    sent = json.loads(served.sent[-1])
    assert sent["model"] == "served"
    assert sent["questions"]["q1"]["criteria"] == {"true": None, "web": None}
    one = {
        "model": JUDGE,
        "state": {"x": 1},
        "questions": {"a": {"type": "noul", "instructions": "?"}},
        "extra": [1],
    }
    response = await served.post(DECISION_ROUTES[1], json.dumps(one).encode())
    assert response.json() == {
        "model": JUDGE,
        "answers": {"a": {"type": "noul", "noul": 0.75}},
        "usage": {"input_tokens": 9},
    }
    assert json.loads(served.sent[-1]) == {**one, "model": "served"}, "passed as sent"
    wrong = await served.post(ROUTES[0], json.dumps({"model": JUDGE, "messages": []}).encode())
    assert _refusal(wrong)["code"] == "wrong_api"


@pytest.mark.anyio
async def test_a_system_one_question_id_given_twice_is_refused(served: Served) -> None:
    """JSON keeps the last of two equal keys; System One's question ids are keys."""
    question = '{"type": "noul", "instructions": "?"}'
    body = (
        f'{{"model": "{JUDGE}", "state": "s", "questions": {{"a": {question}, "a": {question}}}}}'
    )
    error = _refusal(await served.post(DECISION_ROUTES[1], body.encode()))
    assert error["code"] == "invalid_request"
    assert "gives the key 'a' twice in one object" in error["message"]
    assert served.sent == [], "nothing reached the engine"
    chat = f'{{"model": "{MODEL}", "messages": [], "seed": 1, "seed": 2}}'
    assert (await served.post(ROUTES[0], chat.encode())).status_code == 200, "chat as before"


@pytest.mark.anyio
async def test_a_body_shorter_than_its_length_is_a_400(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(requestbody, "READ_IDLE_S", 0.1)

    async def trickle() -> AsyncIterator[bytes]:
        yield b'{"model": "m", '
        await asyncio.Event().wait()  # a client that stops sending without hanging up

    headers = {**AUTH, "Content-Length": "100"}
    response = await served.http.post(ROUTES[0], content=trickle(), headers=headers)
    error = _refusal(response)
    assert error["code"] == "invalid_request"
    assert "stopped after 15 bytes of the 100" in error["message"]


@pytest.mark.anyio
async def test_the_openapi_document_is_open_and_describes_the_bodies(served: Served) -> None:
    document = (await served.http.get("/openapi.json")).json()
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatBody"
    }
    chat = document["components"]["schemas"]["ChatBody"]
    assert chat["required"] == ["model", "messages"]
    assert chat["additionalProperties"] is True, "fields engines take pass through"
    assert document["paths"]["/health"]["get"]["security"] == []


def _openapi_cases() -> st.SearchStrategy[Case[Any]]:
    """Requests drawn from the API's own OpenAPI document (it reads no state, so an app over
    a Redis client that never connects serves it)."""
    idle = State(aioredis.Redis())
    router = Router(Dispatcher(idle, Table(idle, set()), Metrics()), Engines())
    with TestClient(create_app(CREDENTIALS, router)) as http:
        return openapi_cases(http.get("/openapi.json").json())


@pytest.mark.anyio
@FUZZ
@given(case=st.deferred(_openapi_cases))
async def test_schemathesis_finds_no_5xx(served: Served, case: Case[Any]) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        # A model that exists and serves the route, so valid requests are admitted.
        case.body["model"] = JUDGE if case.path in DECISION_ROUTES else MODEL
    response = await send(served.http, case, AUTH)
    assert response.status_code < 500, (case.body, response.text)
    await served.assert_no_place_kept()
