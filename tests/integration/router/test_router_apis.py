"""The router's other APIs over a fake engine: a request for an API its model's engine does
not serve is refused by name before admission (400 `capability_missing:<api>`), and so is
one the engine answers 404 (a route it lacks) or 501 (a model not started for it); the
Anthropic routes take the key as x-api-key and answer in Anthropic's envelope; a non-streamed
message is assembled from the engine's stream; a transcription form reaches the engine with
the engine's model name; /v1/models lists each model's endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from capycommon.credentials import generate
from capycommon.engineclient import Engines
from capycommon.state.stores import State
from capyctl_router.app import Router, create_app
from capyctl_router.dispatch import Dispatcher
from capyctl_router.metrics import Metrics
from capyctl_router.table import Table
from integration.router.fakeengine import engine_serving
from integration.router.ready import put_ready

CREDENTIALS = generate()
AUTH = {"Authorization": f"Bearer {CREDENTIALS.api_key}"}
HOST = "local"
MESSAGE_EVENTS: list[dict[str, Any]] = [
    {
        "type": "message_start",
        "message": {
            "id": "msg_engine",
            "type": "message",
            "role": "assistant",
            "model": "served",
            "content": [],
            "stop_reason": None,
            "usage": {"input_tokens": 7, "output_tokens": 0},
        },
    },
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi "}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "you"}},
    {"type": "content_block_stop", "index": 0},
    {
        "type": "content_block_start",
        "index": 1,
        "content_block": {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"city": '},
    },
    {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '"Paris"}'},
    },
    {"type": "content_block_stop", "index": 1},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 5}},
    {"type": "message_stop"},
]


@dataclass
class Served:
    http: httpx.AsyncClient
    sent: list[httpx.Request] = field(default_factory=list)
    # The status and body the engine answers the next requests with; None: its own answer.
    refusal: tuple[int, dict[str, Any]] | None = None

    def engine(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        if self.refusal is not None:
            return httpx.Response(self.refusal[0], json=self.refusal[1])
        if request.url.path == "/v1/messages":
            events = "".join(
                f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in MESSAGE_EVENTS
            )
            return httpx.Response(200, content=events.encode())
        if request.url.path == "/v1/audio/transcriptions":
            return httpx.Response(200, text="a transcript", headers={"content-type": "text/plain"})
        return httpx.Response(200, json={"model": "served", "results": []})


@pytest.fixture
async def served(redis_socket: Path) -> AsyncIterator[Served]:
    state = State(aioredis.Redis(unix_socket_path=str(redis_socket)))
    served = Served(httpx.AsyncClient())
    engines = Engines()
    async with engine_serving(served.engine) as port:
        await put_ready(state.client, "new", host=HOST, port=port, version="0.32.0")
        await put_ready(state.client, "old", host=HOST, port=port, version="0.11.0")
        await put_ready(state.client, "gguf", "llamacpp", host=HOST, port=port, version="7000")
        table = Table(state, {HOST})
        await table.sync()
        app = create_app(CREDENTIALS, Router(Dispatcher(state, table, Metrics()), engines))
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            served.http = http
            yield served
    engines.close()
    await state.client.aclose()


MESSAGE = {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.anyio
async def test_an_api_the_engine_does_not_serve_is_refused_by_name_before_admission(
    served: Served,
) -> None:
    answer = await served.http.post("/v1/messages", headers=AUTH, json={"model": "old", **MESSAGE})
    assert answer.status_code == 400
    body = answer.json()
    assert body["type"] == "error", "Anthropic's envelope on its route"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "capability_missing:messages"
    assert "model 'old' runs on vLLM 0.11.0" in body["error"]["message"]
    assert "vLLM serves it from 0.11.1" in body["error"]["message"]
    score = await served.http.post("/v1/score", headers=AUTH, json={"model": "gguf"})
    assert score.status_code == 400
    assert score.json()["error"]["code"] == "capability_missing:score"
    assert "llama.cpp serves it in no version" in score.json()["error"]["message"]
    assert served.sent == [], "nothing reached the engine"


@pytest.mark.anyio
async def test_an_engine_that_lacks_the_route_or_the_model_for_it_is_capability_missing(
    served: Served,
) -> None:
    served.refusal = (404, {"detail": "Not Found"})
    answer = await served.http.post("/v1/rerank", headers=AUTH, json={"model": "new"})
    assert (answer.status_code, answer.json()["error"]["code"]) == (
        400,
        "capability_missing:rerank",
    )
    served.refusal = (
        501,
        {"error": {"code": 501, "message": "Start it with `--embeddings`", "type": "x"}},
    )
    answer = await served.http.post("/v1/embeddings", headers=AUTH, json={"model": "gguf"})
    assert answer.json()["error"]["code"] == "capability_missing:embeddings"
    assert "Start it with `--embeddings`" in answer.json()["error"]["message"]
    served.refusal = (404, {"error": {"message": "Response with id 'resp_x' not found."}})
    body = {"model": "new", "input": "hi", "previous_response_id": "resp_x"}
    answer = await served.http.post("/v1/responses", headers=AUTH, json=body)
    assert answer.status_code == 404, "a thing the engine did not find is the engine's answer"
    assert answer.json()["error"]["message"] == "Response with id 'resp_x' not found."


@pytest.mark.anyio
async def test_anthropic_routes_take_x_api_key_and_assemble_a_message(served: Served) -> None:
    refused = await served.http.post(
        "/v1/messages", headers={"x-api-key": "wrong"}, json={"model": "new", **MESSAGE}
    )
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    answer = await served.http.post(
        "/v1/messages", headers={"x-api-key": CREDENTIALS.api_key}, json={"model": "new", **MESSAGE}
    )
    assert answer.status_code == 200, answer.text
    message = answer.json()
    assert message["id"] == answer.headers["x-capyctl-request-id"]
    assert message["model"] == "new"
    assert message["content"] == [
        {"type": "text", "text": "Hi you"},
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"city": "Paris"}},
    ]
    assert (message["stop_reason"], message["usage"]) == (
        "tool_use",
        {"input_tokens": 7, "output_tokens": 5},
    )
    sent = json.loads(served.sent[-1].content)
    assert (sent["model"], sent["stream"]) == ("served", True), "streamed from the engine"
    missing = await served.http.post(
        "/v1/messages", headers=AUTH, json={"model": "new", "messages": []}
    )
    assert missing.status_code == 400
    assert "max_tokens" in missing.json()["error"]["message"]


@pytest.mark.anyio
async def test_a_transcription_form_reaches_the_engine_under_its_served_name(
    served: Served,
) -> None:
    answer = await served.http.post(
        "/v1/audio/transcriptions",
        headers=AUTH,
        data={"model": "new", "response_format": "text"},
        files={"file": ("a.wav", b"RIFF\x00\x01binary\r\n--not-a-boundary", "audio/wav")},
    )
    assert answer.status_code == 200, answer.text
    assert answer.text == "a transcript"
    assert answer.headers["content-type"].startswith("text/plain")
    sent = served.sent[-1]
    assert b'name="model"\r\n\r\nserved\r\n' in sent.content
    assert b"RIFF\x00\x01binary\r\n--not-a-boundary" in sent.content, "the file as it came"
    no_file = await served.http.post(
        "/v1/audio/transcriptions", headers=AUTH, data={"model": "new"}, files={"x": b""}
    )
    assert no_file.status_code == 400
    assert "no file part named 'file'" in no_file.json()["error"]["message"]


@pytest.mark.anyio
async def test_models_list_the_endpoints_each_serves(served: Served) -> None:
    listed = (await served.http.get("/v1/models", headers=AUTH)).json()["data"]
    endpoints = {model["id"]: model["endpoints"] for model in listed}
    assert "/v1/messages" in endpoints["new"]
    assert "/v1/messages" not in endpoints["old"]
    assert "/v1/score" not in endpoints["gguf"]
    assert "/v1/responses" not in endpoints["gguf"], "llama.cpp 7000 is before 7793"
    assert "/tokenize" in endpoints["gguf"]
