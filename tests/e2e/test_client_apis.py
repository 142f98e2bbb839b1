"""OpenAI's Responses and Anthropic's Messages through a real standalone role, with the
clients people use: the openai SDK (`responses`, `embeddings`) and the anthropic SDK
(`messages.create`, `messages.stream`, `messages.count_tokens`). The engine simulator runs
as vLLM 0.29.0 (with a tool call, and its response store on), vLLM 0.11.0 (no Messages API
yet, no response store) and llama.cpp build 8800 (stateless responses, no score route).
Also: an API an engine cannot serve is `400 capability_missing:<api>` in the envelope of the
API asked, never a 404, and GET /v1/models lists each model's endpoints."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from capyctl_router.endpoints import ENDPOINTS
from cluster import SMALL, Cluster, running
from enginesim.install import install_llama_server, install_python_engine

ANSWER = "Hello from the engine simulator."
HI: list[Any] = [{"role": "user", "content": "hi"}]
WEATHER: anthropic.types.ToolParam = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}
# vLLM keeps responses (for previous_response_id) only with this variable set.
STORE = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
LLAMA_BUILD = 8800
# Every path a model of a recent vLLM is served on (GET /v1/models `endpoints`): each of
# the router's endpoints for chat models.
EVERY_PATH = [endpoint.path for endpoint in ENDPOINTS if endpoint.api == "chat"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    """One role for the file, on a GPU every model fits on together: `vl` (vLLM 0.29.0 that
    calls get_weather when offered tools, its response store on), `old` (vLLM 0.11.0) and
    `ll` (llama.cpp build 8800), each started once."""
    with running("client-apis", gpus="gpu0:80GiB") as found:
        installs = {
            "v11": install_python_engine(found.root / "e" / "v11", "vllm", "0.11.0"),
            "llama88": install_llama_server(found.root / "e" / "llama88", LLAMA_BUILD),
        }
        for name, path in installs.items():
            found.ok("engine", "add", str(path), "--name", name)
        found.deploy(
            "vl",
            engine="tools",
            model="small",
            engine_config={**SMALL, "tool_call_parser": "hermes", "env": STORE},
        )
        found.deploy("old", engine="v11", model="small", engine_config=SMALL)
        found.deploy("ll", engine="llama88", model="gguf", engine_config={"context_length": 4096})
        for name in ("vl", "old", "ll"):
            found.start(name)
        yield found


def sdk(cluster: Cluster) -> openai.OpenAI:
    return cluster.openai(timeout=60)


@pytest.fixture(scope="module")
def claude(cluster: Cluster) -> Iterator[anthropic.Anthropic]:
    """The anthropic SDK on the router: its base URL without /v1 (the SDK adds it), the
    API key sent as x-api-key."""
    with anthropic.Anthropic(
        base_url=cluster.base_url.removesuffix("/v1"),
        api_key=cluster.api_key,
        timeout=60,
        max_retries=0,
    ) as client:
        yield client


def post(cluster: Cluster, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    url = f"{cluster.base_url.removesuffix('/v1')}{path}"
    return httpx.post(url, json=body, headers=headers, timeout=60)


def metrics(cluster: Cluster) -> str:
    headers = {"Authorization": f"Bearer {cluster.api_key}"}
    url = f"{cluster.base_url.removesuffix('/v1')}/metrics"
    return httpx.get(url, headers=headers, timeout=10).text


def collapsed(types: list[str]) -> list[str]:
    """Event types with each run of one type kept once (the deltas of an item)."""
    return [kind for i, kind in enumerate(types) if i == 0 or types[i - 1] != kind]


def test_responses_through_the_openai_sdk(cluster: Cluster) -> None:
    client = sdk(cluster)
    raw = client.responses.with_raw_response.create(model="vl", input="hi")
    response = raw.parse()
    assert re.fullmatch(r"resp-[0-9a-f]{24}", raw.headers["X-CapyCTL-Request-Id"])
    assert response.id.startswith("resp_"), "the engine's own id, for previous_response_id"
    assert (response.model, response.status, response.output_text) == ("vl", "completed", ANSWER)
    assert response.usage is not None
    assert response.usage.input_tokens > 0
    assert response.usage.output_tokens > 0
    # Streamed: the events in their order, the deltas adding up to the answer, and the last
    # event holding the whole response.
    events = list(client.responses.create(model="vl", input="hi", stream=True))
    assert collapsed([event.type for event in events]) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == ANSWER
    done = events[-1]
    assert done.type == "response.completed"
    assert (done.response.model, done.response.output_text) == ("vl", ANSWER)
    assert done.response.id != response.id
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = metrics(cluster)
    assert re.search(
        r'capyctl_requests_total\{deployment="vl",outcome="ok",route="responses"\}', text
    )


def test_previous_response_id_continues_where_the_engine_keeps_responses(
    cluster: Cluster,
) -> None:
    """vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1 (the deployment's engine_config.env)
    continues an earlier response, whose turn is then part of the prompt; vLLM without it
    does not know the id (its 404, relayed), and llama.cpp, stateless, refuses it (400)."""
    client = sdk(cluster)
    first = client.responses.create(model="vl", input="My name is Ada.")
    alone = client.responses.create(model="vl", input="What is my name?")
    second = client.responses.create(
        model="vl", input="What is my name?", previous_response_id=first.id
    )
    assert second.output_text == ANSWER
    assert second.previous_response_id == first.id
    assert second.usage is not None
    assert alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens, "the earlier turn was read"
    streamed = list(
        client.responses.create(
            model="vl", input="And again?", previous_response_id=second.id, stream=True
        )
    )
    assert streamed[-1].type == "response.completed"
    assert streamed[-1].response.output_text == ANSWER
    # vLLM without its store.
    kept = client.responses.create(model="old", input="My name is Ada.")
    assert kept.output_text == ANSWER
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model="old", input="hi", previous_response_id=kept.id)
    assert unknown.value.code == "engine_rejected"
    assert f"Response with id '{kept.id}' not found" in unknown.value.message
    # llama.cpp answers responses, and refuses to continue one.
    answered = client.responses.create(model="ll", input="hi")
    assert (answered.model, answered.output_text) == ("ll", ANSWER)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(
                model="ll", input="hi", previous_response_id=answered.id, stream=stream
            )
        assert refused.value.status_code == 400
        assert refused.value.code == "engine_rejected"
        assert "does not support 'previous_response_id'" in refused.value.message


def test_embeddings_through_the_openai_sdk(cluster: Cluster) -> None:
    vectors = sdk(cluster).embeddings.create(model="vl", input=["a cat", "a dog"])
    assert vectors.model == "vl"
    assert [item.index for item in vectors.data] == [0, 1]
    first, second = (item.embedding for item in vectors.data)
    assert len(first) == len(second) > 0
    assert first != second
    assert vectors.usage.prompt_tokens > 0
    again = sdk(cluster).embeddings.create(model="vl", input="a cat")
    assert again.data[0].embedding == first, "one text, one vector"


def test_messages_through_the_anthropic_sdk(cluster: Cluster, claude: anthropic.Anthropic) -> None:
    for model in ("vl", "ll"):
        raw = claude.messages.with_raw_response.create(model=model, max_tokens=64, messages=HI)
        message = raw.parse()
        assert re.fullmatch(r"msg-[0-9a-f]{24}", message.id), "the router's request id"
        assert raw.headers["X-CapyCTL-Request-Id"] == message.id
        # Every message is one from the assistant, though vLLM's stream leaves both unsaid.
        assert (message.type, message.role) == ("message", "assistant")
        assert (message.model, message.stop_reason) == (model, "end_turn")
        # llama.cpp's model thinks first (a thinking block), vLLM's has no reasoning parser.
        kinds = [block.type for block in message.content]
        assert kinds == (["thinking", "text"] if model == "ll" else ["text"])
        assert [block.text for block in message.content if block.type == "text"] == [ANSWER]
        assert message.usage.input_tokens > 0
        assert message.usage.output_tokens > 0
        with claude.messages.stream(model=model, max_tokens=64, messages=HI) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
            assert stream.response.headers["X-CapyCTL-Request-Id"] == final.id
        assert text == ANSWER
        assert final.id != message.id
        assert final.id.startswith("msg-")
        assert (final.type, final.role) == ("message", "assistant"), "as the router says it"
        assert (final.model, final.stop_reason) == (model, "end_turn")
        assert final.usage.output_tokens == message.usage.output_tokens
    text = metrics(cluster)
    assert re.search(
        r'capyctl_requests_total\{deployment="ll",outcome="ok",route="messages"\}', text
    )


def test_a_tool_use_block_streamed_or_not(cluster: Cluster, claude: anthropic.Anthropic) -> None:
    asked: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    message = claude.messages.create(
        model="vl",
        max_tokens=64,
        messages=asked,
        tools=[WEATHER],
    )
    with claude.messages.stream(
        model="vl",
        max_tokens=64,
        messages=asked,
        tools=[WEATHER],
    ) as stream:
        final = stream.get_final_message()
    for found in (message, final):
        assert found.stop_reason == "tool_use"
        uses = [block for block in found.content if block.type == "tool_use"]
        assert [(use.name, use.input) for use in uses] == [("get_weather", {"city": "Paris"})]
        assert uses[0].id
    # The tool's result, sent back: an answer in text.
    (use,) = [block for block in message.content if block.type == "tool_use"]
    turn: list[Any] = [
        *asked,
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny."}],
        },
    ]
    answered = claude.messages.create(model="vl", max_tokens=64, messages=turn)
    assert answered.stop_reason == "end_turn"
    assert [block.type for block in answered.content] == ["text"]


def test_count_tokens_through_the_anthropic_sdk(
    cluster: Cluster, claude: anthropic.Anthropic
) -> None:
    short = claude.messages.count_tokens(model="vl", messages=HI)
    long = claude.messages.count_tokens(
        model="vl", messages=[{"role": "user", "content": "hello there " * 40}]
    )
    assert 0 < short.input_tokens < long.input_tokens
    message = claude.messages.create(model="vl", max_tokens=8, messages=HI)
    assert message.usage.input_tokens == short.input_tokens, "the count is what a message costs"
    assert claude.messages.count_tokens(model="ll", messages=HI).input_tokens > 0


def test_anthropic_errors_in_anthropics_envelope(
    cluster: Cluster, claude: anthropic.Anthropic
) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nosuch", max_tokens=8, messages=HI)
    assert missing.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "no model 'nosuch'; GET /v1/models lists them",
            "code": "unknown_model",
        },
    }
    # max_tokens left out (the SDK requires it: sent through its own HTTP client).
    with pytest.raises(anthropic.BadRequestError) as invalid:
        claude.post("/v1/messages", body={"model": "vl", "messages": HI}, cast_to=object)
    error = error_of(invalid.value)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    assert "max_tokens is required" in error["message"]
    with (
        anthropic.Anthropic(
            base_url=cluster.base_url.removesuffix("/v1"), api_key="wrong", max_retries=0
        ) as refused,
        pytest.raises(anthropic.AuthenticationError) as denied,
    ):
        refused.messages.create(model="vl", max_tokens=8, messages=HI)
    assert error_of(denied.value)["type"] == "authentication_error"


def error_of(exc: anthropic.APIStatusError) -> dict[str, Any]:
    """The `error` of Anthropic's envelope, `{"type": "error", "error": {...}}`."""
    body = exc.body
    assert isinstance(body, dict)
    assert body["type"] == "error"
    error = body["error"]
    assert isinstance(error, dict)
    return error


def test_an_api_the_engine_cannot_serve_is_capability_missing(
    cluster: Cluster, claude: anthropic.Anthropic
) -> None:
    """vLLM 0.11.0 has no Messages API (0.11.1) nor count_tokens (0.17.0); llama.cpp has no
    score route in any build, and answers embeddings only when started with --embeddings
    (its 501). Each is a 400 naming the model, its engine and version, in the envelope of
    the API asked; GET /v1/models lists only the paths each model is served on."""
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="old", max_tokens=8, messages=HI)
    error = error_of(refused.value)
    assert (error["type"], error["code"]) == (
        "invalid_request_error",
        "capability_missing:messages",
    )
    assert "model 'old' runs on vLLM 0.11.0" in error["message"]
    assert "vLLM serves it from 0.11.1" in error["message"]
    with (
        pytest.raises(anthropic.BadRequestError) as streamed,
        claude.messages.stream(model="old", max_tokens=8, messages=HI) as stream,
    ):
        stream.until_done()
    assert error_of(streamed.value)["code"] == "capability_missing:messages"
    with pytest.raises(anthropic.BadRequestError) as counted:
        claude.messages.count_tokens(model="old", messages=HI)
    assert error_of(counted.value)["code"] == "capability_missing:messages.count_tokens"
    # llama.cpp: no score route (refused before it is sent), no embeddings without the flag
    # (its own 501).
    scored = post(cluster, "/v1/score", {"model": "ll", "text_1": "a", "text_2": "b"})
    assert scored.status_code == 400
    found = scored.json()["error"]
    assert (found["type"], found["code"]) == ("invalid_request_error", "capability_missing:score")
    assert f"model 'll' runs on llama.cpp {LLAMA_BUILD}" in found["message"]
    assert "llama.cpp serves it in no version" in found["message"]
    with pytest.raises(openai.BadRequestError) as embedded:
        sdk(cluster).embeddings.create(model="ll", input="a")
    assert embedded.value.code == "capability_missing:embeddings"
    assert "HTTP 501" in embedded.value.message
    assert "--embeddings" in embedded.value.message
    listed = {
        model.id: (model.model_extra or {}).get("endpoints")
        for model in sdk(cluster).models.list().data
    }
    assert listed == {
        "vl": EVERY_PATH,
        "old": [path for path in EVERY_PATH if not path.startswith("/v1/messages")],
        "ll": [path for path in EVERY_PATH if path != "/v1/score"],
    }
    assert cluster.status("old")["requests"]["running"] == 0
